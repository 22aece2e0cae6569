// Test harness: runs a real wprepd process (fork/exec of the built binary) on a Unix
// socket in a fresh temporary folder and on a free loopback TCP port, with its metrics
// on a free loopback port, and talks to it (health, /metrics over HTTP).
#ifndef WPREP_TESTS_SERVER_DAEMON_HARNESS_H_
#define WPREP_TESTS_SERVER_DAEMON_HARNESS_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace wprep::testing {

// Path of the wprepd binary under test ($WPREPD overrides the built-in path).
std::string WprepdPath();

class Daemon {
 public:
  // Starts wprepd with `extra_args` added to the harness's --listen/--metrics-address/
  // --port-file flags and waits (at most `bound`) until it has written its port file.
  // Returns nullptr and sets *error when it did not start.
  static std::unique_ptr<Daemon> Start(const std::vector<std::string>& extra_args,
                                       std::string* error,
                                       absl::Duration bound = absl::Seconds(60));
  ~Daemon();  // kills the process if it still runs and removes the folder

  const std::string& unix_target() const { return unix_target_; }  // "unix:///.../wprepd.sock"
  const std::string& tcp_target() const { return tcp_target_; }    // "127.0.0.1:PORT"
  const std::string& metrics_address() const { return metrics_; }  // "127.0.0.1:PORT"
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

  // grpc.health.v1 Check of `service` over the Unix socket: 1 SERVING, 2 NOT_SERVING,
  // 0 UNKNOWN, or -1 when the RPC failed.
  int Health(const std::string& service = "") const;
  // Polls Health until SERVING (true) or `bound` passes (false).
  bool WaitServing(absl::Duration bound = absl::Seconds(60)) const;
  // Polls Health until it answers `status`, or `bound` passes.
  bool WaitHealth(int status, absl::Duration bound = absl::Seconds(60)) const;

  void Signal(int sig) const;
  // Waits for the process to end; returns its wait status, or -1 when `bound` passed.
  int WaitExit(absl::Duration bound = absl::Seconds(60));
  // What the daemon wrote to stderr so far.
  std::string Log() const;

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string dir_, unix_target_, tcp_target_, metrics_;
};

// GET http://host_port/path; the body, or "" on failure.
std::string HttpGet(const std::string& host_port, const std::string& path);

// Sum of the values of every series `name` whose labels include `labels`, in Prometheus
// text format; nullopt when no series matches.
std::optional<double> MetricValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_DAEMON_HARNESS_H_

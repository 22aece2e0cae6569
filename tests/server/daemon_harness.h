// Test harness: runs a real wprepd process (fork/exec of the built binary) on a Unix
// socket in a fresh temporary folder and on a free loopback TCP port, with its metrics
// on a free loopback port, and talks to it (health, /metrics over HTTP).
#ifndef WPREP_TESTS_SERVER_DAEMON_HARNESS_H_
#define WPREP_TESTS_SERVER_DAEMON_HARNESS_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
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
  struct StartOptions {
    // Run as this user (and its group) instead of the test's; needs root. -1: the test's.
    int uid = -1;
    // Leave out the harness's loopback TCP listener.
    bool no_tcp = false;
    // RLIMIT_NPROC of the daemon (threads of its user, all processes together); 0: as is.
    int nproc_limit = 0;
  };

  // Starts wprepd with `extra_args` added to the harness's --listen/--metrics-address/
  // --port-file flags and waits (at most `bound`) until it has written its port file.
  // Returns nullptr and sets *error when it did not start.
  static std::unique_ptr<Daemon> Start(const std::vector<std::string>& extra_args,
                                       std::string* error,
                                       absl::Duration bound = absl::Seconds(60));
  static std::unique_ptr<Daemon> Start(const std::vector<std::string>& extra_args, std::string* error,
                                       absl::Duration bound, const StartOptions& options);
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
  // The daemon's resident set (VmRSS), bytes; 0 when unreadable.
  uint64_t RssBytes() const;
  // The "health HOST:PORT" line of the port file (--health-listen), or "".
  const std::string& health_address() const { return health_; }

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string dir_, unix_target_, tcp_target_, metrics_, health_;
};

// A thread of a process as /proc/PID/task/TID/stat says: its scheduling policy (SCHED_*)
// and the CPU time it has used, in clock ticks (utime + stime).
struct ThreadStat {
  int tid = 0;
  int policy = 0;
  uint64_t ticks = 0;
};
std::vector<ThreadStat> ThreadsOf(pid_t pid);

// One request line of a daemon log: its end (ts=), handler seconds (seconds=) and kernel
// seconds (kernel_seconds=, 0 where absent).
struct HandlerSpan {
  std::string line;
  absl::Time end;
  double seconds = 0;
  double kernel_seconds = 0;

  // The call's way in (the client's send to the handler's start) and way out (the
  // handler's end to the client's receipt), in microseconds.
  double InMicros(absl::Time sent) const {
    return absl::ToDoubleMicroseconds(end - absl::Seconds(seconds) - sent);
  }
  double OutMicros(absl::Time received) const { return absl::ToDoubleMicroseconds(received - end); }
};
// Every request line of `method` ("Convert", "ConvertBatch", ...) in `log_text`, in order.
std::vector<HandlerSpan> RequestSpans(const std::string& log_text, const std::string& method);

// Lowers a process's RLIMIT_NOFILE soft limit to the descriptors it has open plus `spare`
// (the hard limit stays), so that its next connections run out of descriptors. Restore()
// or the destructor puts the old limit back.
class DescriptorLimit {
 public:
  DescriptorLimit(pid_t pid, int spare);
  ~DescriptorLimit() { Restore(); }
  DescriptorLimit(const DescriptorLimit&) = delete;
  DescriptorLimit& operator=(const DescriptorLimit&) = delete;
  bool ok() const { return ok_; }  // the limit was lowered
  bool Restore();                  // true when the old limit is back (or was never changed)

 private:
  pid_t pid_;
  bool ok_ = false;
  rlimit old_{};
};

// GET http://host_port/path; the body, or "" on failure or after `timeout`.
std::string HttpGet(const std::string& host_port, const std::string& path,
                    absl::Duration timeout = absl::Seconds(10));

// Sum of the values of every series `name` whose labels include `labels`, in Prometheus
// text format; nullopt when no series matches.
std::optional<double> MetricValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_DAEMON_HARNESS_H_

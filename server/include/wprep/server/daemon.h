// The lifecycle of wprepd as one object with named phases:
//   Start   build the parts (metrics, devices, IPC cache, executor, service) and listen;
//           health says NOT_SERVING;
//   WarmUp  run every kernel on every GPU against the CPU engine, learn which IPC handle
//           bytes name the exporting GPU, then call every method over every listener;
//           health says SERVING once done;
//   Serve   housekeeping (idle IPC mappings expire, the heap is trimmed once traffic
//           stops) until a stop is requested;
//   Drain   refuse new work, give in-flight work --drain-timeout, stop the listeners and
//           close the IPC mappings.
#ifndef WPREP_SERVER_DAEMON_H_
#define WPREP_SERVER_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "wprep/server/options.h"

namespace wprep::server {

class DeviceRuntime;
struct DaemonParts;

// What tests hold the daemon by; production leaves it empty. wprepd's command line takes
// it only through the --testing-* flags (TakeDaemonHooks), which are not options.
struct DaemonHooks {
  // When set, warm-up (and so SERVING) waits until this file exists.
  std::string warmup_gate_file;
};

// Moves the --testing-* flags of `args` (--testing-warmup-gate=FILE or
// --testing-warmup-gate FILE) into `hooks`; the rest stay for ParseOptions. InvalidArgument
// for a hook flag without its value.
absl::Status TakeDaemonHooks(std::vector<std::string>& args, DaemonHooks* hooks);

class Daemon {
 public:
  // Builds every part on `runtime` (CudaRuntime() for wprepd) and listens on every
  // --listen address. Errors say which part or address failed.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const Options& options, DeviceRuntime* runtime,
                                                       const DaemonHooks& hooks = {});
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // CANCELLED when a stop was requested meanwhile; any other error means the daemon
  // must not serve (a GPU disagreed with the CPU engine, or failed).
  absl::Status WarmUp();
  // Returns once a stop is requested.
  void Serve();
  // True when every in-flight request finished within --drain-timeout.
  bool Drain(absl::string_view why);
  // Ends WarmUp and Serve. Thread-safe.
  void RequestStop();

 private:
  explicit Daemon(std::unique_ptr<DaemonParts> parts);
  std::unique_ptr<DaemonParts> parts_;
};

// wprepd's main: runs the phases until SIGTERM or SIGINT and returns the process exit
// code (0 after a clean drain, 1 when it could not start or warm up). Call from the main
// thread before any other thread exists: it blocks the shutdown signals for every thread
// and waits for them on one. The process should exit right after (the stopped gRPC and
// metrics servers are left to the exit rather than waiting for peers to hang up).
int RunDaemon(const Options& options, const DaemonHooks& hooks = {});

// wprepd's command line (argv without argv[0]): --help, the flags of options.h, or the
// internal --export-ipc-handles mode the daemon starts itself in (ipc_owner.h). Returns
// the exit code; 2 for bad flags.
int WprepdMain(const std::vector<std::string>& args);

}  // namespace wprep::server

#endif  // WPREP_SERVER_DAEMON_H_

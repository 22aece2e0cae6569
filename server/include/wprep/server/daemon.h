// Lifecycle of wprepd: listen, warm up (health NOT_SERVING until every device is warm),
// serve, and on SIGTERM/SIGINT drain in-flight work within --drain-timeout, close IPC
// mappings and return.
#ifndef WPREP_SERVER_DAEMON_H_
#define WPREP_SERVER_DAEMON_H_

#include "wprep/server/options.h"

namespace wprep::server {

// Runs the daemon until SIGTERM or SIGINT and returns the process exit code (0 after a
// clean drain, 1 when it could not start). Must be called from the main thread before
// any other thread exists: it blocks the shutdown signals so one thread can wait for them.
// After it returns the process should exit: the stopped gRPC and metrics servers are left
// to the process exit rather than waiting for peers to hang up.
int RunDaemon(const Options& options);

}  // namespace wprep::server

#endif  // WPREP_SERVER_DAEMON_H_

// wprepd: the wprep conversion daemon. See wprep/server/options.h for the flags.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "wprep/server/daemon.h"
#include "wprep/server/options.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(wprep::server::Usage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<wprep::server::Options> options = wprep::server::ParseOptions(args);
  if (!options.ok()) {
    std::fprintf(stderr, "wprepd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  const int rc = wprep::server::RunDaemon(*options);
  // Everything of ours is drained and torn down. Skip static destructors: gRPC's library
  // shutdown at exit can wait seconds for peers' idle connections to go away.
  std::fflush(nullptr);
  std::_Exit(rc);
}

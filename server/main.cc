// wprepd: the wprep conversion daemon. `wprepd --help` lists its flags.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "wprep/server/daemon.h"

int main(int argc, char** argv) {
  const int rc = wprep::server::WprepdMain(std::vector<std::string>(argv + 1, argv + argc));
  // Everything of ours is drained and torn down. Skip static destructors: gRPC's library
  // shutdown at exit can wait seconds for peers' idle connections to go away.
  std::fflush(nullptr);
  std::_Exit(rc);
}

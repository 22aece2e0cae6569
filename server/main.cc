// wprepd: the wprep conversion daemon. See wprep/server/options.h for the flags.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "wprep/server/daemon.h"
#include "wprep/server/ipc_owner.h"
#include "wprep/server/options.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // Internal: the daemon runs itself in this mode once at start (see ipc_owner.h).
  constexpr char kExportFlag[] = "--export-ipc-handles=";
  if (args.size() == 1 && args[0].rfind(kExportFlag, 0) == 0) {
    std::vector<int> ordinals;
    for (absl::string_view o : absl::StrSplit(args[0].substr(sizeof(kExportFlag) - 1), ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(o, &v)) return 2;
      ordinals.push_back(v);
    }
    return wprep::server::ExportIpcHandlesMain(ordinals);
  }
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

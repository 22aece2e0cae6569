// `wprep health` against a real wprepd process: the one line it prints and the exit status
// a probe acts on (0 SERVING, 1 any other answer, 2 usage error or no answer).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>

#include "cli_runner.h"
#include "daemon_harness.h"
#include "shared_daemon.h"

namespace wprep {
namespace {

class CliHealthTest : public testing::SharedDaemonTest<CliHealthTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--devices=cpu", "--cpu-threads=2"}); }
};

TEST_F(CliHealthTest, ServingIsOneLineAndExitZeroOnEveryListener) {
  for (const std::string& target : {daemon_->unix_target(), daemon_->tcp_target()}) {
    for (const std::string service : {"", "wprep.v1.WeightPrep"}) {
      const RunResult r = RunCli("health --target " + target + " --service '" + service + "'");
      EXPECT_EQ(r.exit_code, 0) << target << " '" << service << "': " << r.err;
      EXPECT_EQ(r.out, "SERVING\n") << target;
      EXPECT_EQ(r.err, "") << target;
    }
  }
  // --flag=value works the same, and the timeout is honoured as a deadline, not a delay.
  const RunResult r = RunCli("health --target=" + daemon_->unix_target() + " --timeout=2s");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST_F(CliHealthTest, UnknownServiceIsNotFoundExitOne) {
  const RunResult r =
      RunCli("health --target " + daemon_->unix_target() + " --service wprep.v1.NoSuchService");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("NOT_FOUND: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(CliHealthTest, NoDaemonOnTheSocketIsUnavailableExitTwo) {
  const RunResult r = RunCli("health --target unix://" + (dir_ / "nobody.sock").string());
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("UNAVAILABLE: ", 0), 0u) << r.err;
}

// A peer that accepts the connection and never answers: the check gives up at --timeout.
TEST_F(CliHealthTest, SilentPeerIsDeadlineExceededExitTwo) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string target = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const RunResult r = RunCli("health --target " + target + " --timeout 300ms");
  close(fd);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err.rfind("DEADLINE_EXCEEDED: ", 0), 0u) << r.err;
}

TEST_F(CliHealthTest, UsageErrorsAreInvalidArgumentExitTwo) {
  for (const std::string args :
       {"health --bogus 1", "health --timeout 0s", "health --timeout soon", "health --target",
        "health extra", "health --service a --service b", "health --target ''"}) {
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.out << r.err;
    EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << args << ": " << r.err;
  }
  const RunResult help = RunCli("health --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Exit status: 0 SERVING; 1 any other answer; 2"), std::string::npos)
      << help.out;
}

// Until the warm-up finished, the daemon answers NOT_SERVING: exit 1, so a startup probe
// keeps waiting and a readiness probe keeps traffic away.
TEST_F(CliHealthTest, WarmingUpDaemonIsNotServingExitOne) {
  const std::string gate = (dir_ / "gate").string();
  std::string error;
  std::unique_ptr<testing::Daemon> warming =
      testing::Daemon::Start({"--devices=cpu", "--cpu-threads=2", "--testing-warmup-gate=" + gate},
                             &error);
  ASSERT_NE(warming, nullptr) << error;
  const RunResult r = RunCli("health --target " + warming->unix_target());
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(r.out, "NOT_SERVING\n");
  std::ofstream(gate).put('\n');
  ASSERT_TRUE(warming->WaitServing()) << warming->Log();
  const RunResult after = RunCli("health --target " + warming->unix_target());
  EXPECT_EQ(after.exit_code, 0) << after.err;
  EXPECT_EQ(after.out, "SERVING\n");
}

}  // namespace
}  // namespace wprep

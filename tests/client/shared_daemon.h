// A wprepd shared by every test of a suite: the suite's SetUpTestSuite calls
// StartSharedDaemon with its flags, and the daemon stops after the suite's last test.
// Derived (CRTP) gives each suite its own daemon.
#ifndef WPREP_TESTS_CLIENT_SHARED_DAEMON_H_
#define WPREP_TESTS_CLIENT_SHARED_DAEMON_H_

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon_harness.h"

namespace wprep::testing {

template <class Derived, class Base = ::testing::Test>
class SharedDaemonTest : public Base {
 protected:
  static void StartSharedDaemon(const std::vector<std::string>& flags, absl::Duration bound = absl::Seconds(60)) {
    std::string error;
    daemon_ = Daemon::Start(flags, &error, bound).release();
    ASSERT_NE(daemon_, nullptr) << error;
    ASSERT_TRUE(daemon_->WaitServing(bound)) << daemon_->Log();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  static inline Daemon* daemon_ = nullptr;
};

}  // namespace wprep::testing

#endif  // WPREP_TESTS_CLIENT_SHARED_DAEMON_H_

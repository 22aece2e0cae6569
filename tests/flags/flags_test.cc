// wprep::flags: parsing good and bad command lines, and the generated --help.
#include "wprep/flags/flags.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace wprep::flags {
namespace {

FlagSet Example() {
  FlagSet fs("example", "usage: example [flags] FILE");
  fs.Switch("local", "convert in this process");
  fs.Bool("gpu", true, "time the GPU");
  fs.String("target", "ADDR", "", "the daemon's address");
  fs.String("listen", "ADDR", "unix:///tmp/x.sock", "where to listen; repeatable").Repeatable();
  fs.Int("threads", "N", 4, "worker threads", 0, 64);
  fs.Int("offset", "N", 0, "any integer");
  fs.Bytes("budget", "N", 1ull << 30, "memory budget", 1u << 10, 2047ull << 20);
  fs.Duration("wait", "D", absl::Seconds(10), "how long to wait");
  fs.List("shape", "D0,D1", {}, "a comma-separated shape");
  fs.Positional(1, 2);
  return fs;
}

void ExpectError(std::vector<std::string> args, const std::string& part) {
  FlagSet fs = Example();
  const absl::Status s = fs.Parse(args);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << args.front();
  EXPECT_NE(s.message().find(part), absl::string_view::npos) << s << " lacks " << part;
}

TEST(FlagSet, DefaultsWhenNothingIsGiven) {
  FlagSet fs = Example();
  ASSERT_TRUE(fs.Parse({"in.bin"}).ok());
  EXPECT_FALSE(fs.help());
  EXPECT_FALSE(fs.GetSwitch("local"));
  EXPECT_TRUE(fs.GetBool("gpu"));
  EXPECT_FALSE(fs.Has("threads"));
  EXPECT_EQ(fs.GetString("target"), "");
  EXPECT_EQ(fs.GetList("listen"), std::vector<std::string>{"unix:///tmp/x.sock"});
  EXPECT_EQ(fs.GetInt("threads"), 4);
  EXPECT_EQ(fs.GetBytes("budget"), 1ull << 30);
  EXPECT_EQ(fs.GetDuration("wait"), absl::Seconds(10));
  EXPECT_TRUE(fs.GetList("shape").empty());
  EXPECT_EQ(fs.positional(), std::vector<std::string>{"in.bin"});
}

TEST(FlagSet, ParsesBothSpellingsAndEveryKind) {
  FlagSet fs = Example();
  ASSERT_TRUE(fs.Parse({"--local", "--target", "h:1", "--threads=8", "--offset=-3", "--budget", "512M",
                        "--wait=250ms", "--shape=2,,3", "--listen=a", "--listen", "b", "x", "y"})
                  .ok());
  EXPECT_TRUE(fs.GetSwitch("local"));
  EXPECT_TRUE(fs.Has("threads"));
  EXPECT_EQ(fs.GetString("target"), "h:1");
  EXPECT_EQ(fs.GetInt("threads"), 8);
  EXPECT_EQ(fs.GetInt("offset"), -3);
  EXPECT_EQ(fs.GetBytes("budget"), 512ull << 20);
  EXPECT_EQ(fs.GetDuration("wait"), absl::Milliseconds(250));
  EXPECT_EQ(fs.GetList("shape"), (std::vector<std::string>{"2", "3"}));
  // The first --listen replaces the default; the next ones accumulate.
  EXPECT_EQ(fs.GetList("listen"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(fs.positional(), (std::vector<std::string>{"x", "y"}));
}

TEST(FlagSet, BoolsTakeAnOptionalValue) {
  FlagSet off = Example();
  ASSERT_TRUE(off.Parse({"--gpu=false", "f"}).ok());
  EXPECT_FALSE(off.GetBool("gpu"));
  // Alone it is true, and the next argument stays positional.
  FlagSet on = Example();
  ASSERT_TRUE(on.Parse({"--gpu", "f"}).ok());
  EXPECT_TRUE(on.GetBool("gpu"));
  EXPECT_EQ(on.positional(), std::vector<std::string>{"f"});
  ExpectError({"--gpu=maybe", "f"}, "--gpu=maybe is not valid: expected true or false");
}

TEST(FlagSet, BadInputNamesTheFlagAndTheValue) {
  ExpectError({"--bogus=1", "f"}, "unknown flag --bogus (see example --help)");
  ExpectError({"f", "--target"}, "flag --target needs a value");
  ExpectError({"--local=yes", "f"}, "flag --local takes no value");
  ExpectError({"--threads=2", "--threads=3", "f"}, "flag --threads given twice");
  ExpectError({"--threads=many", "f"}, "--threads=many is not valid: expected an integer in [0, 64]");
  ExpectError({"--threads=65", "f"}, "--threads=65");
  ExpectError({"--offset=1.5", "f"}, "--offset=1.5 is not valid: expected an integer");
  ExpectError({"--budget=lots", "f"}, "--budget=lots is not valid: expected a byte count");
  ExpectError({"--budget=4G", "f"}, "--budget=4G is not valid: expected a size between 1K and 2047M");
  ExpectError({"--wait=-1s", "f"}, "--wait=-1s is not valid: expected a non-negative duration");
  ExpectError({"a", "b", "c"}, "unexpected argument 'c' (see example --help)");
  ExpectError({}, "example needs 1 argument (see example --help)");
  ExpectError({"--", "f"}, "unknown flag --");
}

TEST(FlagSet, HelpWinsOverEverythingElse) {
  for (const char* help : {"--help", "-h"}) {
    FlagSet fs = Example();
    ASSERT_TRUE(fs.Parse({"--bogus", help}).ok()) << help;
    EXPECT_TRUE(fs.help());
  }
}

TEST(FlagSet, LastWinsReplacesInsteadOfFailing) {
  FlagSet fs = Example();
  fs.LastWins();
  ASSERT_TRUE(fs.Parse({"--threads=2", "--threads=3", "f"}).ok());
  EXPECT_EQ(fs.GetInt("threads"), 3);
}

TEST(FlagSet, RestKeepsWhatFollowsADoubleDash) {
  FlagSet fs("bench", "usage: bench [flags] [-- daemon flags]");
  fs.Int("iters", "N", 10, "iterations", 1, 1000).AllowRest();
  ASSERT_TRUE(fs.Parse({"--iters=5", "--", "--devices=cpu", "--help"}).ok());
  EXPECT_FALSE(fs.help());
  EXPECT_EQ(fs.GetInt("iters"), 5);
  EXPECT_EQ(fs.rest(), (std::vector<std::string>{"--devices=cpu", "--help"}));
}

TEST(FlagSet, UsageIsGeneratedFromTheDeclarations) {
  const std::string u = Example().Usage();
  EXPECT_EQ(u.rfind("usage: example [flags] FILE\n", 0), 0u) << u;
  EXPECT_NE(u.find("  --local                  convert in this process\n"), std::string::npos) << u;
  EXPECT_NE(u.find("  --gpu[=true|false]       time the GPU (default true)\n"), std::string::npos) << u;
  EXPECT_NE(u.find("  --threads N              worker threads (default 4)\n"), std::string::npos) << u;
  EXPECT_NE(u.find("  --budget N               memory budget (default 1G)\n"), std::string::npos) << u;
  EXPECT_NE(u.find("  --wait D                 how long to wait (default 10s)\n"), std::string::npos) << u;
  // An empty default is not shown.
  EXPECT_NE(u.find("  --target ADDR            the daemon's address\n"), std::string::npos) << u;
}

TEST(FlagSet, UsageWrapsLongHelpAndKeepsTheDefaultWhole) {
  FlagSet fs("p", "usage: p");
  std::string words;
  for (int i = 0; i < 40; ++i) words += "word ";
  fs.Duration("a-rather-long-flag-name", "D", absl::Minutes(5), words);
  const std::string u = fs.Usage();
  // The name is too wide for its column: the help starts on the next line.
  EXPECT_NE(u.find("  --a-rather-long-flag-name D\n                           word"), std::string::npos) << u;
  EXPECT_NE(u.find("(default 5m)"), std::string::npos) << u;
  for (absl::string_view line : absl::StrSplit(u, '\n')) EXPECT_LE(line.size(), 92u) << line;
}

TEST(Bytes, ParseAndFormatRoundTrip) {
  uint64_t v = 0;
  ASSERT_TRUE(ParseBytes("x", "80g", &v).ok());
  EXPECT_EQ(v, 80ull << 30);
  EXPECT_EQ(FormatBytes(v), "80G");
  EXPECT_EQ(FormatBytes(0), "0");
  EXPECT_EQ(FormatBytes(1000), "1000");
  EXPECT_EQ(FormatBytes(1536ull << 20), "1536M");
  EXPECT_FALSE(ParseBytes("x", "99999999999T", &v).ok());
  EXPECT_FALSE(ParseBytes("x", "", &v).ok());
}

}  // namespace
}  // namespace wprep::flags

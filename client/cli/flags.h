// Command-line flags of the `wprep` subcommands: one parser, and the conversion
// parameters every subcommand that names a conversion shares.
#ifndef WPREP_CLIENT_CLI_FLAGS_H_
#define WPREP_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <map>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

// What a subcommand accepts.
struct FlagSpec {
  std::string command;                   // for messages: "see wprep <command> --help"
  std::vector<std::string> with_value;   // "--name VALUE" or "--name=VALUE"
  std::vector<std::string> switches;     // "--name", no value
  size_t min_positional = 0, max_positional = 0;
};

// Parsed flags. Every problem is InvalidArgument naming the flag and the value.
class Flags {
 public:
  // Each flag at most once; anything not starting with "--" is positional.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args, const FlagSpec& spec);

  // The value of a flag, or nullptr when it was not given.
  const std::string* Get(absl::string_view name) const;
  bool Has(absl::string_view name) const;
  // An integer flag, or `fallback` when not given.
  absl::StatusOr<int64_t> Int(absl::string_view name, int64_t fallback) const;
  // "a,b,c" -> integers; empty when not given.
  absl::StatusOr<std::vector<int64_t>> IntList(absl::string_view name) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string, std::less<>> values_;
  std::vector<std::string> positional_;
};

// The flags ParseSpecFlags reads, for FlagSpec::with_value.
extern const std::vector<std::string> kSpecFlags;

// The conversion parameters of `layout` and `direction` from --mx-axis, --mma-version,
// --num-warps, --align-k, --packing-axis, --block-k, --block-n, --to-block-k and --to-block-n
// (defaults as in wprep::ConversionSpec). Range checks that need no shape; MakePlan (or
// the daemon) checks the rest.
absl::StatusOr<ConversionSpec> ParseSpecFlags(const Flags& flags, Layout layout, Direction direction);

// "a,b,c" -> integers, with `flag` in the message.
absl::StatusOr<std::vector<int64_t>> ParseIntList(absl::string_view flag, absl::string_view value);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_FLAGS_H_

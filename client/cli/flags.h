// Command-line flags of the `wprep` subcommands. Each subcommand declares its flags once,
// with help text and defaults, on a wprep::flags::FlagSet (the parser wprepd and the
// benches use too); its --help is that set's generated Usage(). Flags reads the parsed
// set by the flags' command-line spelling ("--layout"), and the conversion parameters
// every subcommand that names a conversion shares are declared and read here.
#ifndef WPREP_CLIENT_CLI_FLAGS_H_
#define WPREP_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "wprep/flags/flags.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

// A subcommand's flag set: `command` as in "wprep <command>", for messages and --help.
flags::FlagSet CommandFlags(absl::string_view command, absl::string_view header);

// Parsed flags. Every problem is InvalidArgument naming the flag and the value.
class Flags {
 public:
  // Parses `args` against `set`'s declarations (each flag at most once).
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args, flags::FlagSet set);

  // A text flag's value ("--name"), or nullptr when it was not given.
  const std::string* Get(absl::string_view name) const;
  bool Has(absl::string_view name) const;
  // A text flag as an integer: its value, else its declared default, else `fallback`.
  absl::StatusOr<int64_t> Int(absl::string_view name, int64_t fallback) const;
  // Every value of a repeatable text flag, in the order given.
  const std::vector<std::string>& List(absl::string_view name) const;
  // "a,b,c" -> integers; empty when not given.
  absl::StatusOr<std::vector<int64_t>> IntList(absl::string_view name) const;
  const std::vector<std::string>& positional() const { return set_.positional(); }

 private:
  explicit Flags(flags::FlagSet set) : set_(std::move(set)) {}
  flags::FlagSet set_;
};

// Declares the conversion parameters ParseSpecFlags reads: --mx-axis, --mma-version,
// --num-warps, --align-k, --packing-axis, --block-k, --block-n, --to-block-k, --to-block-n; or those
// of them `only` names ("mx-axis"). ParseSpecFlags takes an undeclared one as not given.
void AddSpecFlags(flags::FlagSet* set, std::initializer_list<absl::string_view> only = {});

// The conversion parameters of `layout` and `direction` (defaults as in
// wprep::ConversionSpec). Range checks that need no shape; MakePlan (or the daemon) checks
// the rest.
absl::StatusOr<ConversionSpec> ParseSpecFlags(const Flags& flags, Layout layout, Direction direction);

// "a,b,c" -> integers, with `flag` in the message.
absl::StatusOr<std::vector<int64_t>> ParseIntList(absl::string_view flag, absl::string_view value);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_FLAGS_H_

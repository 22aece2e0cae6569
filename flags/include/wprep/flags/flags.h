// One declarative command-line flag parser for wprepd, the wprep CLI and the benches.
//
//   wprep::flags::FlagSet fs("wprep convert", "usage: wprep convert [flags]");
//   fs.Int("threads", "N", 0, "CPU engine threads, 0 = all", 0, 4096);
//   fs.Switch("local", "convert in this process");
//   if (absl::Status s = fs.Parse(args); !s.ok()) ...
//   if (fs.help()) { std::fputs(fs.Usage().c_str(), stdout); ... }
//   int64_t threads = fs.GetInt("threads");
//
// A FlagSet is a plain object, not process-global state, so a program may hold one per
// subcommand and a test may parse many command lines in one process.
//
// Syntax: "--name=value" or "--name value"; a switch is "--name" alone. "--help" and "-h"
// are always accepted. Anything not starting with "--" is positional (bounded by
// Positional()); after a bare "--" every argument is kept as rest() when
// AllowRest() was called. Each flag may be given once (unless LastWins()), except a
// Repeatable() one, which accumulates. Every problem is InvalidArgument naming the flag and the value.
#ifndef WPREP_FLAGS_FLAGS_H_
#define WPREP_FLAGS_FLAGS_H_

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wprep::flags {

enum class Kind {
  kSwitch,    // no value; present or not
  kBool,      // "--name" alone is true; "--name=true|false" (or 1|0) sets it either way
  kString,    // any text
  kInt,       // a decimal integer in [lo, hi]
  kBytes,     // a byte count with an optional K/M/G/T suffix (powers of 1024)
  kDuration,  // a non-negative absl duration: 50ms, 10s, 5m
  kList,      // comma-separated text; empty items are dropped
};

class FlagSet {
 public:
  // `program` names the program in messages ("see wprep convert --help"); `header` opens
  // Usage(): the usage line and what the program does.
  FlagSet(std::string program, std::string header);

  // Declarations, in the order --help lists them. `value` names the value in --help
  // ("ADDR", "N"); a default that is empty (or, for an integer, `no_default`) is not shown.
  // Declaring a name twice is a programming error and aborts.
  FlagSet& Switch(absl::string_view name, absl::string_view help);
  FlagSet& Bool(absl::string_view name, bool def, absl::string_view help);
  FlagSet& String(absl::string_view name, absl::string_view value, absl::string_view def,
                  absl::string_view help);
  FlagSet& Int(absl::string_view name, absl::string_view value, int64_t def, absl::string_view help,
               int64_t lo = std::numeric_limits<int64_t>::min(),
               int64_t hi = std::numeric_limits<int64_t>::max());
  FlagSet& Bytes(absl::string_view name, absl::string_view value, uint64_t def, absl::string_view help,
                 uint64_t lo = 0, uint64_t hi = std::numeric_limits<uint64_t>::max());
  FlagSet& Duration(absl::string_view name, absl::string_view value, absl::Duration def,
                    absl::string_view help);
  FlagSet& List(absl::string_view name, absl::string_view value, std::vector<std::string> def,
                absl::string_view help);
  // The flag declared last may be given more than once: its values accumulate (the first
  // one given replaces the default). For a string, the list holds every value given.
  FlagSet& Repeatable();
  // The flag declared last shows no default in --help (its help says what unset means).
  FlagSet& HideDefault();
  // How many positional arguments are accepted (the header names them).
  FlagSet& Positional(size_t min, size_t max);
  // Keep the arguments after a bare "--" (e.g. flags passed on to a child process).
  FlagSet& AllowRest();
  // A flag given again replaces its earlier value instead of failing "given twice": for a
  // daemon whose launchers append overrides to a base command line.
  FlagSet& LastWins();
  // Text printed after the flags in Usage().
  FlagSet& Footer(absl::string_view text);

  // Parses `args` (without argv[0]) into this set; call once. When --help or -h is among
  // them, returns OK at once with help() true, checking nothing else.
  absl::Status Parse(const std::vector<std::string>& args);

  bool help() const { return help_; }
  // Whether the flag was given on the command line.
  bool Has(absl::string_view name) const;
  // Whether the set declares the flag.
  bool Declared(absl::string_view name) const { return index_.count(name) != 0; }
  // Typed values: what was given, else the default. Asking for an undeclared name or the
  // wrong kind is a programming error and aborts.
  bool GetSwitch(absl::string_view name) const;
  bool GetBool(absl::string_view name) const;
  const std::string& GetString(absl::string_view name) const;
  int64_t GetInt(absl::string_view name) const;
  uint64_t GetBytes(absl::string_view name) const;
  absl::Duration GetDuration(absl::string_view name) const;
  // A list flag's items, or every value of a repeatable string flag.
  const std::vector<std::string>& GetList(absl::string_view name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  const std::vector<std::string>& rest() const { return rest_; }

  // The --help text: the header, then one entry per flag (name, value, help, default).
  std::string Usage() const;
  const std::string& program() const { return program_; }

 private:
  struct Flag {
    std::string name;
    Kind kind = Kind::kString;
    std::string value_name, help, default_text;
    bool repeatable = false, given = false;
    int64_t lo = 0, hi = 0;  // kInt
    uint64_t ulo = 0, uhi = 0;  // kBytes
    // The value: given, else the default.
    bool on = false;
    std::string text;
    std::vector<std::string> list;
    int64_t number = 0;
    uint64_t bytes = 0;
    absl::Duration duration;
  };

  Flag& Declare(absl::string_view name, Kind kind, absl::string_view value, absl::string_view help);
  const Flag& Find(absl::string_view name, Kind kind) const;
  absl::Status Set(Flag& f, const std::string& value);

  std::string program_, header_, footer_;
  std::vector<Flag> flags_;
  std::map<std::string, size_t, std::less<>> index_;
  size_t min_positional_ = 0, max_positional_ = 0;
  bool allow_rest_ = false, last_wins_ = false, help_ = false;
  std::vector<std::string> positional_, rest_;
};

// "--help" or "-h" among `args`.
bool WantsHelp(const std::vector<std::string>& args);

// Value parsers the FlagSet uses, for programs that read values from elsewhere. `flag` names
// the flag in the message.
absl::Status ParseBytes(absl::string_view flag, absl::string_view v, uint64_t* out);
// 1073741824 -> "1G", 0 -> "0", 1000 -> "1000".
std::string FormatBytes(uint64_t v);

}  // namespace wprep::flags

#endif  // WPREP_FLAGS_FLAGS_H_

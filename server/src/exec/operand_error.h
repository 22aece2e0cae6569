// Errors about one operand of a request (its source, destination, chosen GPU or fences), raised
// below the wire edge. Code under the edge names the operand by role, never by a protobuf
// field; the edge turns the role into the request's field path when it answers
// (WireFieldOf in proto_translate.h): "source_ipc.device_uuid: GPU-... is not a GPU ...".
#ifndef WPREP_SERVER_SRC_OPERAND_ERROR_H_
#define WPREP_SERVER_SRC_OPERAND_ERROR_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace wprep::server {

// The fences (client_fence.h) are the batch's: an error about one carries no item index;
// its part starts with "event" or "word".
enum class Operand { kSource, kDestination, kDevice, kWaitFence, kSignalFence };

// Where an OperandError points: the operand, a part of it ("device_uuid", "handle",
// possibly empty), and for multi-item requests the item's index (-1 for none).
struct OperandPath {
  Operand operand = Operand::kSource;
  std::string part;
  int item = -1;
};

inline constexpr char kOperandPayload[] = "wprep.operand";

// `status` (not OK) marked as being about `part` of `operand`.
inline absl::Status OperandError(Operand operand, absl::string_view part, absl::Status status) {
  status.SetPayload(kOperandPayload,
                    absl::Cord(absl::StrCat(static_cast<int>(operand), "|", part, "|-1")));
  return status;
}

// `status` (an OperandError or any other) marked as being about item `item`.
inline absl::Status ForItem(int item, absl::Status status) {
  auto p = status.GetPayload(kOperandPayload);
  if (!p) return status;
  std::vector<std::string> parts = absl::StrSplit(std::string(*p), '|');
  if (parts.size() != 3) return status;
  status.SetPayload(kOperandPayload, absl::Cord(absl::StrCat(parts[0], "|", parts[1], "|", item)));
  return status;
}

// The path of an OperandError; nullopt for other statuses.
inline std::optional<OperandPath> OperandPathOf(const absl::Status& status) {
  auto p = status.GetPayload(kOperandPayload);
  if (!p) return std::nullopt;
  std::vector<std::string> parts = absl::StrSplit(std::string(*p), '|');
  int op = 0, item = -1;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &op) || op < 0 || op > static_cast<int>(Operand::kSignalFence) ||
      !absl::SimpleAtoi(parts[2], &item)) {
    return std::nullopt;
  }
  return OperandPath{static_cast<Operand>(op), parts[1], item};
}

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_OPERAND_ERROR_H_

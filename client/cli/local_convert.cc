#include "local_convert.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep::cli {

absl::StatusOr<std::vector<uint8_t>> ReadWholeFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open input file '", path, "': ", std::strerror(errno)));
  const std::streamoff size = f.tellg();
  if (size < 0) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  std::vector<uint8_t> data(static_cast<size_t>(size));
  f.seekg(0);
  if (size > 0 && !f.read(reinterpret_cast<char*>(data.data()), size)) {
    return absl::DataLossError(absl::StrCat("short read from '", path, "'"));
  }
  return data;
}

absl::Status WriteFileAtomically(const std::string& path, const uint8_t* data, size_t size) {
  const std::string tmp = path + ".wprep-tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create output file '", path, "': ", std::strerror(errno)));
    }
    if (size > 0) f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!f.flush()) {
      std::remove(tmp.c_str());
      return absl::ResourceExhaustedError(absl::StrCat("short write to '", tmp, "'"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("cannot rename into '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string FormatResult(const ConvertResult& r) {
  return absl::StrCat("output_shape [", absl::StrJoin(r.shape, ", "), "] output_strides [",
                      absl::StrJoin(r.strides, ", "), "] output_bytes ", r.bytes);
}

absl::StatusOr<ConvertResult> RunLocalConvert(const ConvertArgs& args) {
  auto device = ParseDevice(args.device);
  if (!device.ok()) return device.status();
  // Validate everything that needs no input bytes before reading the file.
  auto shape_only = MakePlan(args.spec, args.shape, InputBinding{args.input_strides, std::nullopt});
  if (!shape_only.ok()) return shape_only.status();
  auto input = ReadWholeFile(args.input);
  if (!input.ok()) return input.status();
  auto plan = MakePlan(args.spec, args.shape, InputBinding{args.input_strides, input->size()});
  if (!plan.ok()) return plan.status();

  std::vector<uint8_t> output(plan->output_bytes);
  absl::Status s =
      *device < 0
          ? ConvertOnCpu(*plan, input->data(), input->size(), output.data(), output.size(),
                         {args.threads})
          : ConvertHostBuffersOnCuda(*plan, input->data(), input->size(), output.data(),
                                     output.size(), *device);
  if (!s.ok()) return s;
  if (s = WriteFileAtomically(args.output, output.data(), output.size()); !s.ok()) return s;
  return ConvertResult{plan->output_shape, plan->output_strides, plan->output_bytes};
}

}  // namespace wprep::cli

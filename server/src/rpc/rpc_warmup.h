// Self warm-up of the RPC path: before health says SERVING, wprepd calls every method of
// wprep.v1.WeightPrep on each of its own listening addresses through real gRPC channels,
// so the first client request does not pay for cold code pages, lazy initialization in
// gRPC and protobuf, or first use of the transports and the heap (measured on an H200:
// a first Convert took 0.6 ms against 0.24 ms warm, a first ListDevices 0.34 ms).
// These calls carry kWarmupMetadataKey with a per-process secret token; the handlers keep
// calls with the right token out of metrics, logs and request ids (service.cc).
#ifndef WPREP_SERVER_SRC_RPC_WARMUP_H_
#define WPREP_SERVER_SRC_RPC_WARMUP_H_

#include <atomic>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wprep::server {

// Request metadata that marks the daemon's own warm-up calls; its value is the token.
inline constexpr char kWarmupMetadataKey[] = "x-wprep-warmup";

// A fresh random 128-bit token as 32 hex digits, from the kernel's CSPRNG. Only the
// process that made it knows it, so no client can hide its requests from the metrics.
std::string NewWarmupToken();

// The gRPC target that reaches a listening address from this host: "unix:///path" as
// is; "HOST:PORT" with `bound_port` (the port actually bound, for HOST:0) and a wildcard
// host (0.0.0.0, [::]) replaced by loopback.
std::string WarmupTarget(const std::string& listen_address, int bound_port);

// Connects to `target` and calls, each with a deadline no later than `bound` from now:
// ListDevices; Plan; Convert (inline bytes both ways) with three swizzles on each engine
// ListDevices reports (every GPU by UUID, else the CPU engine); one ConvertStream on each
// engine; RegisterIpcHandles and ReleaseIpcHandles with no handles (valid no-ops).
// Checks that every call succeeds and every output has the planned byte count. Returns
// the number of calls made, or the first failure (the call and its gRPC status);
// Cancelled when `stop` became true, checked between calls.
absl::StatusOr<int> WarmUpRpcPath(const std::string& target, const std::string& token,
                                  absl::Duration bound, const std::atomic<bool>& stop);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_RPC_WARMUP_H_

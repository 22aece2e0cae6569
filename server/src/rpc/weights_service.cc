#include "rpc/weights_service.h"

#include <atomic>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "net/peer_credentials.h"
#include "rpc/proto_translate.h"
#include "rpc/service.h"
#include "rpc/status.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {
namespace {

std::atomic<uint64_t> g_weights_request_id{1ull << 62};  // apart from the converter's ids

absl::StatusOr<std::vector<WeightRuleSpec>> RulesFromProto(
    const google::protobuf::RepeatedPtrField<wprep::v1::WeightRule>& rules) {
  std::vector<WeightRuleSpec> out;
  for (int i = 0; i < rules.size(); ++i) {
    const wprep::v1::WeightRule& r = rules[i];
    const std::string field = absl::StrCat("rules[", i, "]");
    if (r.pattern().empty()) {
      return WithFieldViolation(absl::InvalidArgumentError(absl::StrCat(field, ".pattern: empty")),
                                field + ".pattern");
    }
    WeightRuleSpec rule;
    rule.pattern = r.pattern();
    if (r.action_case() == wprep::v1::WeightRule::kConvert) {
      absl::StatusOr<ConversionSpec> spec = SpecFromProto(r.convert(), field + ".convert");
      if (!spec.ok()) return WithFieldViolation(spec.status(), field + ".convert");
      if (spec->direction != Direction::kSwizzle) {
        return WithFieldViolation(
            absl::InvalidArgumentError(absl::StrCat(field, ".convert.direction: a rule prepares checkpoint "
                                                    "tensors, so it takes swizzles only")),
            field + ".convert.direction");
      }
      rule.convert = *spec;
      rule.checkpoint = r.checkpoint();
    } else if (r.checkpoint()) {
      return WithFieldViolation(absl::InvalidArgumentError(absl::StrCat(
                                    field, ".checkpoint: says how a conversion reads the tensor; give convert too")),
                                field + ".checkpoint");
    }
    if (r.has_slice()) {
      const wprep::v1::WeightSlice& sl = r.slice();
      if (sl.start() < 0 || sl.length() < 1) {
        return WithFieldViolation(
            absl::InvalidArgumentError(absl::StrCat(field, ".slice: start ", sl.start(), ", length ", sl.length(),
                                                    "; want start >= 0 and length >= 1")),
            field + ".slice");
      }
      rule.slice = WeightSliceSpec{sl.axis(), sl.start(), sl.length()};
    }
    out.push_back(std::move(rule));
  }
  return out;
}

// The request's GPU: device_uuid (16 bytes) or device_index, not both; neither: host
// memory. INVALID_ARGUMENT naming the field.
absl::StatusOr<WeightPlacement> PlacementFromProto(const wprep::v1::LoadWeightsRequest& r) {
  WeightPlacement place;
  if (!r.device_uuid().empty()) {
    if (r.has_device_index()) {
      return WithFieldViolation(absl::InvalidArgumentError("device_index: give device_uuid or device_index, not both"),
                                "device_index");
    }
    absl::StatusOr<Uuid> u = UuidFromWire(r.device_uuid(), "device_uuid");
    if (!u.ok()) return WithFieldViolation(u.status(), "device_uuid");
    place.gpu = *u;
  } else if (r.has_device_index()) {
    place.gpu_index = r.device_index();
  }
  place.vmm = r.vmm();
  return place;
}

}  // namespace

absl::StatusOr<std::vector<PreloadSet>> ReadWeightPreload(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--preload ", path, ": cannot be read"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.size() > (16u << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--preload ", path, ": larger than 16 MiB"));
  }
  // The parser's errors name line and column; collect the first.
  class Errors final : public google::protobuf::io::ErrorCollector {
   public:
    void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
      if (first.empty()) first = absl::StrCat("line ", line + 1, ", column ", column + 1, ": ", message);
    }
    std::string first;
  };
  Errors errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  wprep::v1::WeightPreload preload;
  if (!parser.ParseFromString(text, &preload)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload ", path, ": not a text-format wprep.v1.WeightPreload: ", errors.first));
  }
  std::vector<PreloadSet> sets;
  std::set<std::string> names;
  for (int i = 0; i < preload.sets_size(); ++i) {
    const wprep::v1::LoadWeightsRequest& r = preload.sets(i);
    const std::string where = absl::StrCat("--preload ", path, ": sets[", i, "]");
    if (!ValidWeightSetName(r.name())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".name '", r.name(),
                                                     "': want 1 to 64 characters of [A-Za-z0-9._-]"));
    }
    if (!names.insert(r.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".name '", r.name(), "' is given twice"));
    }
    absl::StatusOr<WeightPlacement> place = PlacementFromProto(r);
    if (!place.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ".", place.status().message()));
    absl::StatusOr<std::vector<WeightRuleSpec>> rules = RulesFromProto(r.rules());
    if (!rules.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ".", rules.status().message()));
    sets.push_back(PreloadSet{r.name(), r.path(), *std::move(rules), *place});
  }
  return sets;
}

void WeightManifestToProto(const WeightManifestData& manifest, bool with_tensors, wprep::v1::WeightManifest* out) {
  out->set_name(manifest.name);
  out->set_path(manifest.path);
  out->set_total_bytes(manifest.total_bytes);
  out->set_source_checksum(manifest.source_checksum);
  if (manifest.gpu.has_value()) {
    out->set_device_uuid(std::string(reinterpret_cast<const char*>(manifest.gpu->data()), manifest.gpu->size()));
  }
  out->set_vmm(manifest.vmm);
  if (!with_tensors) return;
  for (const WeightEntry& e : manifest.tensors) {
    wprep::v1::WeightTensor* t = out->add_tensors();
    t->set_name(e.name);
    t->set_dtype(e.dtype);
    for (int64_t d : e.shape) t->add_shape(d);
    for (int64_t s : e.strides) t->add_strides(s);
    t->set_bytes(e.bytes);
    t->set_offset(e.offset);
    t->set_rule(e.rule);
    if (e.spec.has_value()) *t->mutable_identity() = IdentityToProto(*e.spec);
    if (e.slice.has_value()) {
      wprep::v1::WeightSlice* sl = t->mutable_slice();
      sl->set_axis(e.slice->axis);
      sl->set_start(e.slice->start);
      sl->set_length(e.slice->length);
    }
  }
}

grpc::Status WeightSetsService::LoadWeights(grpc::ServerContext* ctx, const wprep::v1::LoadWeightsRequest* req,
                                            grpc::ServerWriter<wprep::v1::LoadWeightsResponse>* writer) {
  return ToGrpcStatus(BoundMessage(RunGuarded(
      [&]() -> absl::Status {
        absl::StatusOr<WeightPlacement> place = PlacementFromProto(*req);
        if (!place.ok()) return place.status();
        WPREP_ASSIGN_OR_RETURN(std::vector<WeightRuleSpec> rules, RulesFromProto(req->rules()));
        const absl::Time start = absl::Now();
        auto progress = [&](const WeightLoadProgress& p) {
          if (ctx->IsCancelled()) return false;
          wprep::v1::LoadWeightsResponse msg;
          msg.set_tensors_done(p.tensors_done);
          msg.set_tensors_total(p.tensors_total);
          msg.set_bytes_done(p.bytes_done);
          msg.set_bytes_total(p.bytes_total);
          return writer->Write(msg);
        };
        WPREP_ASSIGN_OR_RETURN(std::shared_ptr<const WeightManifestData> manifest,
                               store_->Load(req->name(), req->path(), rules, progress, *place));
        wprep::v1::LoadWeightsResponse last;
        last.set_tensors_done(manifest->tensors.size());
        last.set_tensors_total(manifest->tensors.size());
        last.set_bytes_done(manifest->total_bytes);
        last.set_bytes_total(manifest->total_bytes);
        last.set_load_seconds(absl::ToDoubleSeconds(absl::Now() - start));
        WeightManifestToProto(*manifest, /*with_tensors=*/true, last.mutable_manifest());
        writer->Write(last);  // a client gone by now finds the set listed
        return absl::OkStatus();
      },
      g_weights_request_id.fetch_add(1))));
}

grpc::Status WeightSetsService::ListWeights(grpc::ServerContext* /*ctx*/, const wprep::v1::ListWeightsRequest* req,
                                            wprep::v1::ListWeightsResponse* resp) {
  for (const WeightSetSummary& s : store_->List()) {
    wprep::v1::WeightSetInfo* info = resp->add_sets();
    WeightManifestToProto(*s.manifest, req->with_tensors(), info->mutable_manifest());
    info->set_attachments(s.attachments);
  }
  resp->set_budget_bytes(store_->budget_bytes());
  resp->set_resident_bytes(store_->resident_bytes());
  return grpc::Status::OK;
}

grpc::Status WeightSetsService::AttachWeights(grpc::ServerContext* ctx, const wprep::v1::AttachWeightsRequest* req,
                                              grpc::ServerWriter<wprep::v1::AttachWeightsResponse>* writer) {
  const std::optional<PeerCredentials> peer = UnixPeers::Global().Lookup(ctx->peer());
  absl::StatusOr<WeightAttachment> a =
      store_->Attach(req->name(), peer.has_value() ? std::optional<pid_t>(peer->pid) : std::nullopt);
  if (!a.ok()) return ToGrpcStatus(a.status());
  wprep::v1::AttachWeightsResponse msg;
  msg.set_attachment_id(a->id);
  msg.set_shm_path(a->shm_path);
  msg.set_ipc_handle(a->ipc_handle);
  if (!a->vmm_token.empty()) msg.mutable_vmm()->set_token(a->vmm_token);
  WeightManifestToProto(*a->manifest, /*with_tensors=*/true, msg.mutable_manifest());
  // A client gone before the manifest reached it is detached at once.
  const bool sent = writer->Write(msg);
  return ToGrpcStatus(store_->Hold(a->id, [&] { return !sent || ctx->IsCancelled(); }));
}

grpc::Status WeightSetsService::DetachWeights(grpc::ServerContext* /*ctx*/, const wprep::v1::DetachWeightsRequest* req,
                                              wprep::v1::DetachWeightsResponse* /*resp*/) {
  return ToGrpcStatus(store_->Detach(req->attachment_id()));
}

grpc::Status WeightSetsService::DropWeights(grpc::ServerContext* /*ctx*/, const wprep::v1::DropWeightsRequest* req,
                                            wprep::v1::DropWeightsResponse* resp) {
  absl::StatusOr<uint64_t> freed = store_->Drop(req->name(), req->force());
  if (!freed.ok()) return ToGrpcStatus(freed.status());
  resp->set_freed_bytes(*freed);
  return grpc::Status::OK;
}

}  // namespace wprep::server

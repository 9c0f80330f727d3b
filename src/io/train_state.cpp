// Training-state checkpoints and weight files (see typegrad/io/train_state.hpp, Note [training-state checkpoints]).
#include "typegrad/io/train_state.hpp"
#include "typegrad/io/model_config.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace tg::io {

using json = nlohmann::json;

namespace {
constexpr const char* kFormat = "typegrad.train_state";
constexpr const char* kFormatVersion = "1";
constexpr const char* kOptimPrefix = "optim.";

std::string hex8(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error("checkpoint: ", path, ": ", what); }

// ---- the record as JSON -----------------------------------------------------------------------------
json record_to_json(const TrainStateRecord& r) {
  json j;
  j["step"] = r.step;
  j["schedule_step"] = r.schedule_step;
  j["sampler"] = {{"seed", r.sampler.seed}, {"counter", r.sampler.counter}};
  json gens = json::object();
  for (const auto& [name, g] : r.generators) gens[name] = {{"seed", g.seed}, {"offset", g.offset}};
  j["generators"] = gens;
  j["grad_accum"] = r.grad_accum ? json{{"n", r.grad_accum->n}, {"micro_index", r.grad_accum->micro_index},
                                        {"steps", r.grad_accum->steps}}
                                 : json(nullptr);
  j["scaler"] = r.scaler ? json{{"scale", r.scaler->scale}, {"growth_tracker", r.scaler->growth_tracker},
                                {"skipped_steps", r.scaler->skipped_steps}, {"steps", r.scaler->steps}}
                         : json(nullptr);
  json scalars = json::object();
  for (const auto& [k, v] : r.scalars) scalars[k] = v;
  j["scalars"] = scalars;
  json config;
  try {
    config = json::parse(r.config_json.empty() ? std::string("{}") : r.config_json);
  } catch (const json::exception& e) {
    throw Error("save_train_state: config_json is not valid JSON: ", e.what());
  }
  TG_CHECK(config.is_object(), "save_train_state: config_json must be a JSON object, got ", config.type_name());
  j["config"] = config;
  j["optimizer"] = r.optimizer;
  j["run_id"] = r.run_id;
  if (!r.model_json.empty()) {
    json model;
    try {
      model = json::parse(r.model_json);
    } catch (const json::exception& e) {
      throw Error("save_train_state: model_json is not valid JSON: ", e.what());
    }
    TG_CHECK(model.is_object(), "save_train_state: model_json must be a JSON object, got ", model.type_name());
    j["model"] = model;
  }
  if (!r.tokenizer_json.empty()) j["tokenizer"] = r.tokenizer_json;  // verbatim: the tokenizer parses it
  return j;
}

/// Strict field access: each names the field and the expected type when it fails.
struct Fields {
  const std::string& path;
  const json& at(const json& obj, const std::string& ctx, const char* key) const {
    if (!obj.is_object()) fail(path, "state field '" + ctx + "' must be an object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(path, "state field '" + ctx + (ctx.empty() ? "" : ".") + key + "' is missing");
    return *it;
  }
  std::int64_t i64(const json& obj, const std::string& ctx, const char* key, bool non_negative = true) const {
    const json& v = at(obj, ctx, key);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)))
      fail(path, "state field '" + ctx + (ctx.empty() ? "" : ".") + key + "' must be an integer, got " + v.dump());
    const auto x = v.get<std::int64_t>();
    if (non_negative && x < 0) fail(path, "state field '" + ctx + (ctx.empty() ? "" : ".") + key + "' is negative (" + std::to_string(x) + ")");
    return x;
  }
  std::uint64_t u64(const json& obj, const std::string& ctx, const char* key) const {
    const json& v = at(obj, ctx, key);
    if (v.is_number_unsigned()) return v.get<std::uint64_t>();
    if (v.is_number_integer() && v.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(v.get<std::int64_t>());
    fail(path, "state field '" + ctx + (ctx.empty() ? "" : ".") + key + "' must be a non-negative integer, got " + v.dump());
  }
  double f64(const json& obj, const std::string& ctx, const char* key) const {
    const json& v = at(obj, ctx, key);
    if (!v.is_number()) fail(path, "state field '" + ctx + (ctx.empty() ? "" : ".") + key + "' must be a number, got " + v.dump());
    return v.get<double>();
  }
};

TrainStateRecord record_from_json(const json& j, const std::string& path) {
  const Fields f{path};
  if (!j.is_object()) fail(path, "metadata \"tg.state\" must be a JSON object");
  TrainStateRecord r;
  r.step = f.i64(j, "", "step");
  r.schedule_step = f.i64(j, "", "schedule_step");
  const json& s = f.at(j, "", "sampler");
  r.sampler.seed = f.u64(s, "sampler", "seed");
  r.sampler.counter = f.u64(s, "sampler", "counter");
  const json& gens = f.at(j, "", "generators");
  if (!gens.is_object()) fail(path, "state field 'generators' must be an object");
  for (auto it = gens.begin(); it != gens.end(); ++it)
    r.generators[it.key()] = {f.u64(it.value(), "generators." + it.key(), "seed"), f.u64(it.value(), "generators." + it.key(), "offset")};
  const json& ga = f.at(j, "", "grad_accum");
  if (!ga.is_null()) {
    r.grad_accum = GradAccumRecord{f.i64(ga, "grad_accum", "n"), f.i64(ga, "grad_accum", "micro_index"), f.i64(ga, "grad_accum", "steps")};
    if (r.grad_accum->n < 1 || r.grad_accum->micro_index >= r.grad_accum->n)
      fail(path, "state field 'grad_accum' is inconsistent: n " + std::to_string(r.grad_accum->n) + ", micro_index " +
                     std::to_string(r.grad_accum->micro_index));
  }
  const json& sc = f.at(j, "", "scaler");
  if (!sc.is_null())
    r.scaler = ScalerStateRecord{f.f64(sc, "scaler", "scale"), f.i64(sc, "scaler", "growth_tracker"), f.i64(sc, "scaler", "skipped_steps"),
                                  f.i64(sc, "scaler", "steps")};
  const json& scalars = f.at(j, "", "scalars");
  if (!scalars.is_object()) fail(path, "state field 'scalars' must be an object");
  for (auto it = scalars.begin(); it != scalars.end(); ++it) r.scalars[it.key()] = f.f64(scalars, "scalars", it.key().c_str());
  const json& config = f.at(j, "", "config");
  if (!config.is_object()) fail(path, "state field 'config' must be an object");
  r.config_json = config.dump();
  const json& opt = f.at(j, "", "optimizer");
  if (!opt.is_string()) fail(path, "state field 'optimizer' must be a string");
  r.optimizer = opt.get<std::string>();
  if (auto it = j.find("run_id"); it != j.end()) {  // absent in files written before run ids
    if (!it->is_string() || it->get<std::string>().size() > 64)
      fail(path, "state field 'run_id' must be a string of at most 64 characters, got " + it->dump().substr(0, 80));
    r.run_id = it->get<std::string>();
    for (char c : r.run_id)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_')
        fail(path, "state field 'run_id' may hold only letters, digits, '-' and '_', got " + it->dump());
  }
  if (auto it = j.find("model"); it != j.end()) {  // absent in files written before it was recorded
    if (!it->is_object()) fail(path, "state field 'model' must be an object, got " + it->dump().substr(0, 80));
    r.model_json = it->dump();
  }
  if (auto it = j.find("tokenizer"); it != j.end()) {
    if (!it->is_string()) fail(path, "state field 'tokenizer' must be a string, got " + it->dump().substr(0, 80));
    r.tokenizer_json = it->get<std::string>();
  }
  return r;
}

/// Opens `path`, checks that it is a training checkpoint with intact tensors and state, returns the record.
TrainStateRecord open_checked(const SafetensorsReader& rd) {
  const std::string& path = rd.path();
  const auto format = rd.metadata_value("format");
  if (format != std::string(kFormat))
    fail(path, "not a typegrad training checkpoint (metadata \"format\" is " + (format ? "'" + *format + "'" : std::string("absent")) +
                   ", expected '" + kFormat + "'; a weights file loads with --init-from / load_weights)");
  const auto version = rd.metadata_value("format_version");
  if (version != std::string(kFormatVersion))
    fail(path, "unsupported checkpoint format_version " + (version ? "'" + *version + "'" : std::string("(absent)")) +
                   ", this build reads version " + kFormatVersion);
  const auto state = rd.metadata_value("tg.state");
  if (!state) fail(path, "metadata \"tg.state\" is missing");
  const auto state_crc = rd.metadata_value("tg.state.crc32c");
  if (!state_crc) fail(path, "metadata \"tg.state.crc32c\" is missing");
  const std::string got = hex8(crc32c(state->data(), state->size()));
  if (*state_crc != got)
    fail(path, "checksum mismatch for metadata \"tg.state\": stored crc32c " + *state_crc + ", the text gives " + got);
  rd.verify_checksums(/*required=*/true);
  json j;
  try {
    j = json::parse(*state);
  } catch (const json::exception& e) {
    fail(path, std::string("metadata \"tg.state\" is not valid JSON: ") + e.what());
  }
  return record_from_json(j, path);
}

/// Checks that `rd` holds each parameter as F32 with its shape (`convert`: any floating dtype).
void check_params(const SafetensorsReader& rd, const ParamsView& params, bool convert, const char* who) {
  for (const ParamsView::Entry& p : params) {
    if (!rd.contains(p.name)) throw Error(who, ": ", rd.path(), ": missing tensor '", p.name, "' (a parameter of the model)");
    const TensorInfo& t = rd.info(p.name);
    const bool dtype_ok = t.dtype == DType::f32 ||
                          (convert && (t.dtype == DType::f64 || t.dtype == DType::f16 || t.dtype == DType::bf16));
    if (!dtype_ok)
      throw Error(who, ": ", rd.path(), ": tensor '", p.name, "' has dtype ", dtype_safetensors_name(t.dtype),
                  ", expected F32", convert ? " (or F64, F16, BF16)" : "");
    if (!(t.shape == p.shape))
      throw Error(who, ": ", rd.path(), ": tensor '", p.name, "' has shape ", t.shape, ", the model's parameter has shape ",
                  p.shape);
  }
}

/// Throws NonFiniteTensor when tensor `name` of `rd` (a floating dtype) holds a NaN or an infinity.
void check_finite(const SafetensorsReader& rd, const std::string& name, const char* who) {
  const TensorInfo& t = rd.info(name);
  std::int64_t count = 0, first = -1;
  double first_value = 0;
  auto scan = [&](std::int64_t n, auto&& value_at) {
    for (std::int64_t i = 0; i < n; ++i) {
      const double v = value_at(i);
      if (std::isfinite(v)) continue;
      if (count++ == 0) first = i, first_value = v;
    }
  };
  if (t.dtype == DType::f32) {
    const auto b = rd.bytes(name);
    scan(static_cast<std::int64_t>(b.size() / 4), [&](std::int64_t i) {
      float v;
      std::memcpy(&v, b.data() + 4 * i, 4);
      return static_cast<double>(v);
    });
  } else if (t.dtype == DType::f64 || t.dtype == DType::f16 || t.dtype == DType::bf16) {
    const Tensor<fp64> v = rd.get_converted<fp64>(name);
    scan(v.numel(), [&](std::int64_t i) { return v.data()[i]; });
  } else {
    return;
  }
  if (count > 0)
    throw NonFiniteTensor(who, ": ", rd.path(), ": tensor '", name, "' holds ", count, " non-finite value", count > 1 ? "s" : "",
                          " (the first, at flat index ", first, ", is ", first_value, "); nothing was loaded");
}

void check_params_finite(const SafetensorsReader& rd, const ParamsView& params, const char* who) {
  for (const ParamsView::Entry& p : params) check_finite(rd, p.name, who);
}

void copy_params(const SafetensorsReader& rd, const ParamsView& params) {
  for (const ParamsView::Entry& p : params) {
    const TensorInfo& t = rd.info(p.name);
    p.write(t.dtype == DType::f32 ? rd.get<fp32>(p.name) : rd.get_converted<fp32>(p.name));
  }
}
}  // namespace

// ---- training state ---------------------------------------------------------------------------------
void save_train_state(const std::string& path, const ParamsView& params, const optim::AnyOptimizer& opt,
                      const TrainStateRecord& record, const AuxTensors& aux) {
  TrainStateRecord r = record;
  r.optimizer = opt.name();
  const std::string state = record_to_json(r).dump();
  SafetensorsWriter w;
  for (const ParamsView::Entry& p : params) {
    TG_CHECK(!p.name.starts_with(kOptimPrefix) && !p.name.starts_with(kAuxPrefix), "save_train_state: parameter name '",
             p.name, "' uses a reserved prefix ('", kOptimPrefix, "' or '", kAuxPrefix, "')");
    w.add(p.name, p.read());
  }
  for (const optim::NamedTensor& e : opt.state_tensors()) w.add(kOptimPrefix + e.name, e.tensor);
  for (const auto& [name, t] : aux) {
    TG_CHECK(name.starts_with(kAuxPrefix) && name.size() > std::strlen(kAuxPrefix), "save_train_state: auxiliary tensor '",
             name, "' must be named '", kAuxPrefix, "<name>'");
    w.add(name, t);  // the writer copies a non-contiguous view (without recording)
  }
  w.set_metadata("format", kFormat);
  w.set_metadata("format_version", kFormatVersion);
  w.set_metadata("tg.state", state);
  w.set_metadata("tg.state.crc32c", hex8(crc32c(state.data(), state.size())));
  w.write(path);
}

TrainStateRecord read_train_state_record(const std::string& path) {
  return open_checked(SafetensorsReader::open(path));
}

TrainStateRecord load_train_state(const std::string& path, const ParamsView& params, optim::AnyOptimizer& opt,
                                  const LoadOptions& options, AuxTensors* aux) {
  const SafetensorsReader rd = SafetensorsReader::open(path);
  TrainStateRecord r = open_checked(rd);
  if (r.optimizer != opt.name())
    fail(path, "the checkpoint holds " + r.optimizer + " state, the optimizer is " + std::string(opt.name()));
  check_params(rd, params, /*convert=*/false, "checkpoint");
  if (!options.allow_non_finite)
    for (const TensorInfo& t : rd.tensors()) check_finite(rd, t.name, "checkpoint");
  std::set<std::string> names;
  for (const ParamsView::Entry& p : params) names.insert(p.name);
  std::vector<optim::NamedTensor> state;
  AuxTensors found;
  for (const TensorInfo& t : rd.tensors()) {
    if (names.count(t.name)) continue;
    if (t.name.starts_with(kAuxPrefix)) {
      if (aux == nullptr)
        fail(path, "the checkpoint holds pruning masks ('" + t.name +
                       "'); resume it with its pruning settings (train_gpt --prune), or start from its weights with --init-from");
      if (t.dtype != DType::u8)
        fail(path, "auxiliary tensor '" + t.name + "' has dtype " + std::string(dtype_safetensors_name(t.dtype)) + ", expected U8");
      found.emplace_back(t.name, rd.get<std::uint8_t>(t.name));
      continue;
    }
    if (!t.name.starts_with(kOptimPrefix))
      fail(path, "unexpected tensor '" + t.name + "': not a parameter of the model, not optimizer state (\"optim.*\") and not a " +
                     "pruning mask (\"prune.*\")");
    if (t.dtype != DType::f32)
      fail(path, "optimizer state '" + t.name + "' has dtype " + std::string(dtype_safetensors_name(t.dtype)) + ", expected F32");
    state.push_back({t.name.substr(std::strlen(kOptimPrefix)), rd.get<fp32>(t.name)});
  }
  // load_state checks every entry before it changes anything (Note [optimizer state]).
  try {
    opt.load_state(state);
  } catch (const Error& e) {
    fail(path, std::string("optimizer state does not fit the optimizer: ") + e.what());
  }
  copy_params(rd, params);
  if (aux != nullptr) *aux = std::move(found);
  return r;
}

AuxTensors read_aux_tensors(const std::string& path) {
  const SafetensorsReader rd = SafetensorsReader::open(path);
  open_checked(rd);
  AuxTensors out;
  for (const TensorInfo& t : rd.tensors()) {
    if (!t.name.starts_with(kAuxPrefix)) continue;
    if (t.dtype != DType::u8)
      fail(path, "auxiliary tensor '" + t.name + "' has dtype " + std::string(dtype_safetensors_name(t.dtype)) + ", expected U8");
    out.emplace_back(t.name, rd.get<std::uint8_t>(t.name));
  }
  return out;
}

// ---- weights ----------------------------------------------------------------------------------------
void save_weights(const std::string& path, const ParamsView& params, const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w;
  for (const ParamsView::Entry& p : params) w.add(p.name, p.read());
  w.set_metadata("format", "pt");
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  w.write(path);
}

void load_weights(const std::string& path, const ParamsView& params, const LoadOptions& options) {
  const SafetensorsReader rd = SafetensorsReader::open(path);
  const bool is_checkpoint = rd.metadata_value("format") == std::string(kFormat);
  if (is_checkpoint) open_checked(rd);
  else rd.verify_checksums(/*required=*/false);
  check_params(rd, params, /*convert=*/!is_checkpoint, "load_weights");
  std::set<std::string> names;
  for (const ParamsView::Entry& p : params) names.insert(p.name);
  for (const TensorInfo& t : rd.tensors()) {
    if (names.count(t.name) || (is_checkpoint && (t.name.starts_with(kOptimPrefix) || t.name.starts_with(kAuxPrefix)))) continue;
    throw Error("load_weights: ", path, ": unexpected tensor '", t.name, "' (not a parameter of the model)");
  }
  if (!options.allow_non_finite) check_params_finite(rd, params, "load_weights");
  copy_params(rd, params);
}

// ---- configurations ---------------------------------------------------------------------------------
std::vector<std::string> config_differences(const std::string& saved_json, const std::string& current_json) {
  json a, b;
  try {
    a = json::parse(saved_json);
    b = json::parse(current_json);
  } catch (const json::exception& e) {
    throw Error("config_differences: not valid JSON: ", e.what());
  }
  TG_CHECK(a.is_object() && b.is_object(), "config_differences: both configurations must be JSON objects");
  std::vector<std::string> out;
  std::set<std::string> keys;
  for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
  for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
  for (const auto& k : keys) {
    const std::string x = a.contains(k) ? a[k].dump() : "(absent)", y = b.contains(k) ? b[k].dump() : "(absent)";
    if (x != y) out.push_back(k + ": checkpoint " + x + ", now " + y);
  }
  return out;
}

// ---- checkpoint directories -------------------------------------------------------------------------
namespace {
/// The step of a complete checkpoint's file name "ckpt-<digits>.safetensors", or -1.
std::int64_t step_of(const std::string& name) {
  constexpr std::string_view prefix = "ckpt-", suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix)) return -1;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  return std::stoll(digits);
}

bool is_directory(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_dirs(const std::string& dir) {
  std::string at;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    at = dir.substr(0, pos);
    if (at.empty() || is_directory(at)) continue;
    if (::mkdir(at.c_str(), 0755) != 0 && errno != EEXIST)
      throw Error("checkpoint: cannot create directory '", at, "': ", std::strerror(errno));
  }
}
}  // namespace

CheckpointDir::CheckpointDir(std::string dir, std::int64_t keep) : dir_(std::move(dir)), keep_(keep) {
  TG_CHECK(!dir_.empty(), "CheckpointDir: the directory name is empty");
  TG_CHECK(keep >= 0, "CheckpointDir: keep must be >= 0 (0 keeps all), got ", keep);
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  struct stat st {};
  if (::stat(dir_.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    throw Error("checkpoint: '", dir_, "' exists and is not a directory");
  make_dirs(dir_);
}

void CheckpointDir::check_writable() const {
  const std::string probe = dir_ + "/.typegrad-write-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("checkpoint: cannot write into directory '", dir_, "': ", std::strerror(errno));
  const char byte = 0;
  const bool ok = ::write(fd, &byte, 1) == 1;
  const int err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!ok) throw Error("checkpoint: cannot write into directory '", dir_, "': ", std::strerror(err));
}

std::string CheckpointDir::path_for(std::int64_t step) const {
  TG_CHECK(step >= 0, "CheckpointDir: step must be >= 0, got ", step);
  char buf[32];
  std::snprintf(buf, sizeof buf, "ckpt-%08lld.safetensors", static_cast<long long>(step));
  return dir_ + "/" + buf;
}

std::vector<std::pair<std::int64_t, std::string>> CheckpointDir::list() const {
  std::vector<std::pair<std::int64_t, std::string>> out;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) throw Error("checkpoint: cannot read directory '", dir_, "': ", std::strerror(errno));
  while (const dirent* e = ::readdir(d)) {
    const std::int64_t s = step_of(e->d_name);
    if (s >= 0) out.emplace_back(s, dir_ + "/" + e->d_name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> CheckpointDir::latest() const {
  const auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

std::vector<std::pair<std::int64_t, std::string>> CheckpointDir::other_runs(const std::string& run_id) const {
  auto all = list();
  std::erase_if(all, [&](const auto& e) { return checkpoint_run_id(e.second) == run_id; });
  return all;
}

std::string CheckpointDir::save(const ParamsView& params, const optim::AnyOptimizer& opt, const TrainStateRecord& record,
                                const AuxTensors& aux) {
  const std::string path = path_for(record.step);
  if (::access(path.c_str(), F_OK) == 0) {
    const auto owner = checkpoint_run_id(path);
    if (owner != record.run_id)
      throw Error("checkpoint: ", path, " belongs to another run (",
                  owner ? (owner->empty() ? std::string("one without a run id") : "run " + *owner) : std::string("an unreadable file"),
                  "); not replacing it");
  }
  save_train_state(path, params, opt, record, aux);
  if (keep_ > 0) {
    auto mine = list();
    // Only this run's checkpoints count and go (never another run's), and never what was just written.
    std::erase_if(mine, [&](const auto& e) { return e.second == path || checkpoint_run_id(e.second) != record.run_id; });
    const auto keep_others = static_cast<std::size_t>(keep_ - 1);
    for (std::size_t i = 0; i + keep_others < mine.size(); ++i) ::unlink(mine[i].second.c_str());
  }
  remove_stale_temporaries();
  return path;
}

std::int64_t CheckpointDir::remove_stale_temporaries() const {
  // ".ckpt-<step>.safetensors.tmp-<pid>-<n>" (write_file_atomic); a live writer's are left alone.
  std::vector<std::string> stale;
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      const auto at = n.find(".safetensors.tmp-");
      if (!n.starts_with(".ckpt-") || at == std::string::npos) continue;
      const std::string rest = n.substr(at + std::strlen(".safetensors.tmp-"));
      const auto dash = rest.find('-');
      const std::string pid_text = rest.substr(0, dash);
      if (pid_text.empty() || pid_text.size() > 9 || !std::all_of(pid_text.begin(), pid_text.end(), ::isdigit)) continue;
      const long pid = std::stol(pid_text);
      if (pid == static_cast<long>(::getpid())) continue;
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.push_back(dir_ + "/" + n);
    }
    ::closedir(d);
  }
  std::int64_t removed = 0;
  for (const auto& s : stale) removed += ::unlink(s.c_str()) == 0;
  return removed;
}

std::optional<std::string> checkpoint_run_id(const std::string& path) {
  // The header only: 8 bytes of length, then the JSON header with "__metadata__" (Note [safetensors]).
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  unsigned char len_bytes[8];
  if (!f.read(reinterpret_cast<char*>(len_bytes), 8)) return std::nullopt;
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len == 0 || len > (std::uint64_t{100} << 20)) return std::nullopt;
  std::string header(static_cast<std::size_t>(len), '\0');
  if (!f.read(header.data(), static_cast<std::streamsize>(len))) return std::nullopt;
  try {
    const json h = json::parse(header);
    const json& meta = h.at("__metadata__");
    if (meta.at("format").get<std::string>() != kFormat) return std::nullopt;
    const json state = json::parse(meta.at("tg.state").get<std::string>());
    if (!state.is_object()) return std::nullopt;
    auto it = state.find("run_id");
    if (it == state.end()) return std::string();
    if (!it->is_string()) return std::nullopt;
    return it->get<std::string>();
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

ResumeChoice choose_resume(const std::string& dir_or_file, bool fallback_to_intact) {
  if (!is_directory(dir_or_file)) {
    if (::access(dir_or_file.c_str(), R_OK) != 0)
      throw Error("--resume: '", dir_or_file, "' is neither a checkpoint file nor a directory: ", std::strerror(errno));
    return {dir_or_file, {}};
  }
  const auto all = CheckpointDir(dir_or_file).list();
  if (all.empty()) throw Error("--resume: no checkpoint (ckpt-<step>.safetensors) in directory '", dir_or_file, "'");
  ResumeChoice choice;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      choice.record = read_train_state_record(it->second);  // format, state checksum, every tensor's checksum
      choice.path = it->second;
      return choice;
    } catch (const Error& e) {
      if (!fallback_to_intact)
        throw Error("--resume: the newest checkpoint in '", dir_or_file, "' is damaged: ", e.what());
      choice.skipped.emplace_back(it->second, e.what());
    }
  }
  throw Error("--resume: no intact checkpoint in directory '", dir_or_file, "' (", all.size(), " damaged)");
}

std::string resolve_resume(const std::string& dir_or_file) { return choose_resume(dir_or_file).path; }


// ---- the model's shape ------------------------------------------------------------------------------
std::string gpt_config_json(const nn::GPTConfig& c) {
  json j{{"vocab_size", c.vocab_size}, {"block_size", c.block_size}, {"n_layer", c.n_layer},
         {"n_head", c.n_head},         {"n_embd", c.n_embd},         {"dropout", c.dropout}};
  if (c.vocab_multiple != 1) j["vocab_multiple"] = c.vocab_multiple;  // Note [padded vocabulary]: storage only
  return j.dump();
}

nn::GPTConfig gpt_config_from_json(std::string_view text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(origin, ": the model description is not valid JSON: ", e.what());
  }
  if (!j.is_object()) throw Error(origin, ": the model description must be a JSON object");
  auto count = [&](const char* key) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer() || it->get<std::int64_t>() <= 0)
      throw Error(origin, ": the model description's '", key, "' must be a positive integer",
                  it == j.end() ? std::string(" (missing)") : ", got " + it->dump());
    return it->get<std::int64_t>();
  };
  nn::GPTConfig c;
  c.vocab_size = count("vocab_size");
  c.block_size = count("block_size");
  c.n_layer = count("n_layer");
  c.n_head = count("n_head");
  c.n_embd = count("n_embd");
  if (auto it = j.find("dropout"); it != j.end()) {
    if (!it->is_number()) throw Error(origin, ": the model description's 'dropout' must be a number, got ", it->dump());
    c.dropout = it->get<float>();
  }
  if (j.contains("vocab_multiple")) c.vocab_multiple = count("vocab_multiple");
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(origin, ": ", e.what());
  }
  return c;
}

}  // namespace tg::io

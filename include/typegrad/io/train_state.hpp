// Training-state checkpoints (fp32 master weights, optimizer state, schedule / sampler / RNG / accumulation
// positions, loss-scaler numbers, the run's configuration) as checksummed safetensors, saved atomically.
//   tg::io::CheckpointDir ckpts("runs/a", /*keep=*/3);  ckpts.save(params, opt, record);   // on any device
//   auto rec = tg::io::load_train_state(tg::io::resolve_resume("runs/a"), params, opt);  // then restore positions
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "typegrad/core/random.hpp"
#include "typegrad/data/sampler.hpp"
#include "typegrad/io/safetensors.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::io {

// Note [training-state checkpoints]
// One safetensors file per checkpoint (docs/checkpoints.md has the full layout):
//   tensors   "<param>"            F32, every model parameter under its GPT-2 name (so the file also
//                                  loads as plain weights, in typegrad or in PyTorch)
//             "optim.<entry>"      F32, BasicOptimizer::state_tensors() ("optim.h.0.mlp.c_fc.weight.exp_avg",
//                                  "optim.h.0.mlp.c_fc.weight.step", "optim.optimizer.step")
//   metadata  "format"             "typegrad.train_state"        "format_version"  "1"
//             "tg.state"           JSON of TrainStateRecord (the plain numbers below, the config)
//             "tg.state.crc32c"    CRC32C of the "tg.state" text
//             "tg.crc32c"          per-tensor CRC32C (Note [checksums])
// Saving happens between optimizer steps (after GradAccum's N-th micro-step), where the gradients are
// zero and only the numbers below describe the position; resume restores them and continues with the
// same batches, dropout masks and learning rates, so the run is bit-identical to one never stopped.
// Loading checks everything (format, checksums, name set, dtypes, shapes, optimizer kind) before it
// changes anything: on an error the model and optimizer are as they were.
// The parameters and the optimizer may live on any device (ParamsView, optim::AnyOptimizer: the tensors
// travel as host fp32 copies, Note [optimizer state]), and the file does not record which: a checkpoint
// written by a CPU run resumes on a GPU and the other way round.

/// A model's parameters as the checkpoint functions see them, on any device: each one's name and shape, a
/// host fp32 tensor of its values (the parameter itself on the CPU, a copy from a device) and a write of
/// host values into it. Made implicitly from a std::vector<optim::BasicParam<D>>; it refers to the
/// parameters' tensors (shared), so it is made for a call, not kept.
class ParamsView {
 public:
  struct Entry {
    std::string name;
    Shape shape;
    std::function<Tensor<fp32>()> read;
    std::function<void(const Tensor<fp32>&)> write;
  };
  template <Device D>
  ParamsView(const std::vector<optim::BasicParam<D>>& params) {  // NOLINT(google-explicit-constructor)
    entries_.reserve(params.size());
    for (const optim::BasicParam<D>& p : params)
      entries_.push_back({p.name, p.tensor.shape(), [t = p.tensor] { return t.detach().template to<cpu>(); },
                          [t = p.tensor](const Tensor<fp32>& host) {
                            tg::detail::copy_tensor(host.detach().template to<D>().detach(), t);
                          }});
  }
  const std::vector<Entry>& entries() const { return entries_; }
  auto begin() const { return entries_.begin(); }
  auto end() const { return entries_.end(); }

 private:
  std::vector<Entry> entries_;
};

/// A tg::Generator's whole state.
struct GeneratorRecord {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  bool operator==(const GeneratorRecord&) const = default;
};
inline GeneratorRecord record_of(const Generator& g) { return {g.seed(), g.offset()}; }
inline void restore(Generator& g, const GeneratorRecord& r) { g.set_state(r.seed, r.offset); }

/// Gradient-accumulation position: N, micro-batches done since the last optimizer step (0 at a
/// checkpoint), optimizer steps taken through the accumulator.
struct GradAccumRecord {
  std::int64_t n = 1;
  std::int64_t micro_index = 0;
  std::int64_t steps = 0;
  bool operator==(const GradAccumRecord&) const = default;
};

/// A dynamic loss scaler's numbers (amp::DynamicScaler: scale, consecutive finite steps, skipped steps).
struct ScalerStateRecord {
  double scale = 65536.0;
  std::int64_t growth_tracker = 0;
  std::int64_t skipped_steps = 0;
  std::int64_t steps = 0;  ///< optimizer steps attempted through the scaler (taken + skipped)
  bool operator==(const ScalerStateRecord&) const = default;
};

/// Everything in a training checkpoint besides the tensors.
struct TrainStateRecord {
  std::int64_t step = 0;           ///< optimizer steps completed (the trainer's step counter)
  std::int64_t schedule_step = 0;  ///< optim::Schedule::step()
  data::SamplerPosition sampler;   ///< the training sampler's position
  std::map<std::string, GeneratorRecord> generators;  ///< e.g. "init", "dropout", "sample"
  std::optional<GradAccumRecord> grad_accum;
  std::optional<ScalerStateRecord> scaler;
  std::map<std::string, double> scalars;  ///< free-form numbers (running loss averages, token counts)
  std::string config_json = "{}";         ///< the run's configuration, a JSON object
  std::string optimizer;                  ///< Optimizer::name(); filled by save, checked by load
  std::string run_id;                     ///< the run that wrote it (Note [runs own their checkpoints]); "" in old files
  std::string model_json;                 ///< the model's shape as a JSON object (GPTConfig); "" when not recorded
  std::string tokenizer_json;             ///< the tokenizer that made the tokens (data::AnyTokenizer::to_json); "" when not recorded
  bool operator==(const TrainStateRecord&) const = default;
};

/// Thrown when a file's floating tensor holds NaN or infinite values (the weights of a run that diverged);
/// loading rejects such files unless LoadOptions::allow_non_finite.
class NonFiniteTensor : public Error {
 public:
  using Error::Error;
};

struct LoadOptions {
  bool allow_non_finite = false;  ///< load tensors holding NaN / inf as they are
};

/// Tensors a checkpoint carries besides the parameters and the optimizer state, as host U8 tensors under the
/// reserved prefix kAuxPrefix: the pruning masks, "prune.mask.<param>" (quant::Pruner::mask_tensors, Note
/// [pruning masks]).
using AuxTensors = std::vector<std::pair<std::string, Tensor<std::uint8_t>>>;
inline constexpr const char* kAuxPrefix = "prune.";

/// Writes a training checkpoint of `params` and `opt` (on any device) to `path` atomically (Note [atomic
/// file replacement]), with the auxiliary tensors `aux` (each name starts with kAuxPrefix).
void save_train_state(const std::string& path, const ParamsView& params, const optim::AnyOptimizer& opt,
                      const TrainStateRecord& record, const AuxTensors& aux = {});
/// Loads a checkpoint written by save_train_state into `params` and `opt` (on any device; all checks first,
/// see the Note) and returns its record; restoring the positions it holds is the caller's part.
/// Every tensor (parameters and optimizer state) must be finite unless `options` allows otherwise.
/// The file's auxiliary tensors go to `*aux` (checking them is the caller's part, before it changes anything
/// else); a file that has some and a caller that passes no `aux` is an error, so masks are never dropped.
TrainStateRecord load_train_state(const std::string& path, const ParamsView& params, optim::AnyOptimizer& opt,
                                  const LoadOptions& options = {}, AuxTensors* aux = nullptr);
/// The auxiliary tensors of a checkpoint (verified like every load), without loading anything.
AuxTensors read_aux_tensors(const std::string& path);
/// The record of a checkpoint without loading its tensors (tensors and checksums are still verified).
TrainStateRecord read_train_state_record(const std::string& path);

/// Weights only: every parameter as F32 under its name, checksummed, `metadata` added ("format": "pt" by
/// default, which PyTorch-side tools expect).
void save_weights(const std::string& path, const ParamsView& params, const std::map<std::string, std::string>& metadata = {});
/// Loads weights into `params` from a weights file (exactly the parameters' names; floating dtypes are
/// converted to fp32) or from a training checkpoint (its "optim.*" tensors are ignored). Checksums are
/// verified when the file has them. All checks happen before any parameter changes, the finiteness of every
/// value among them (NonFiniteTensor) unless `options` allows otherwise.
void load_weights(const std::string& path, const ParamsView& params, const LoadOptions& options = {});

/// The keys whose values differ between two JSON configurations ("lr: checkpoint 0.002, now 0.001"),
/// for a trainer to report when a run is resumed with other settings.
std::vector<std::string> config_differences(const std::string& saved_json, const std::string& current_json);

// Note [runs own their checkpoints]
// A save directory can hold checkpoints of several runs (a user reusing --save-dir). Each record carries
// the id of the run that wrote it (TrainStateRecord::run_id: a fresh run draws one, a resumed run keeps its
// checkpoint's), read back cheaply from the file's header (checkpoint_run_id). CheckpointDir::save deletes
// beyond `keep` only checkpoints of the saving run and never replaces another run's file; a trainer refuses
// to start a fresh run into a directory that holds another run's checkpoints unless told to share it.
// Temporaries of saves that were killed (".ckpt-<step>.safetensors.tmp-<pid>-<n>") are removed when their
// process is gone: on opening the directory and after each save.

/// A checkpoint's run id from its header alone (no tensor is read): "" for files written without one,
/// nullopt when the file is not a readable training checkpoint.
std::optional<std::string> checkpoint_run_id(const std::string& path);

/// A directory of checkpoints "ckpt-<step, 8+ digits>.safetensors", keeping the newest `keep` (0: all) of
/// each run (Note [runs own their checkpoints]).
class CheckpointDir {
 public:
  /// Creates the directory when missing (throws when it cannot).
  explicit CheckpointDir(std::string dir, std::int64_t keep = 0);
  /// Throws unless a file can be created in the directory (a trainer calls it before its first step, so a
  /// read-only or full save directory is found then, not at the first save).
  void check_writable() const;
  const std::string& dir() const { return dir_; }
  std::string path_for(std::int64_t step) const;
  /// Complete checkpoints (temporaries never match), ascending by step.
  std::vector<std::pair<std::int64_t, std::string>> list() const;
  std::optional<std::string> latest() const;
  /// The complete checkpoints whose run id is not `run_id` (unreadable ones included), ascending by step.
  std::vector<std::pair<std::int64_t, std::string>> other_runs(const std::string& run_id) const;
  /// Saves step `record.step`, then deletes the oldest of `record.run_id`'s checkpoints beyond `keep`;
  /// returns the path written. Throws, writing nothing, when the path holds another run's checkpoint.
  std::string save(const ParamsView& params, const optim::AnyOptimizer& opt, const TrainStateRecord& record,
                   const AuxTensors& aux = {});
  /// Removes the temporaries of killed saves whose process is gone; returns how many.
  std::int64_t remove_stale_temporaries() const;

 private:
  std::string dir_;
  std::int64_t keep_ = 0;
};

/// resolve_resume's answer: the checkpoint to load, and the newer ones that were passed over because they
/// failed verification (path, reason) when a fallback was allowed.
struct ResumeChoice {
  std::string path;
  std::vector<std::pair<std::string, std::string>> skipped;
  std::optional<TrainStateRecord> record;  ///< the chosen checkpoint's record, when it was verified here (a directory)
};

/// --resume's argument: a checkpoint file as is, or a directory's newest checkpoint, verified (format,
/// checksums). A directory whose newest checkpoint is damaged is an error naming it, or, with
/// `fallback_to_intact`, the newest intact one (the damaged ones listed in `skipped`). Error when none.
ResumeChoice choose_resume(const std::string& dir_or_file, bool fallback_to_intact = false);
/// choose_resume(dir_or_file).path.
std::string resolve_resume(const std::string& dir_or_file);

}  // namespace tg::io

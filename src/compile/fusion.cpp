// tg::compile's fusion rewrite: finding chains of elementwise ops and fusing them (Note [fusion rewrites]).
#include "typegrad/compile/fusion.hpp"

#include <algorithm>
#include <cstdlib>
#include <array>
#include <sstream>
#include <utility>

#include "typegrad/autodiff/region.hpp"
#include "typegrad/core/error.hpp"

namespace tg {
namespace capture {

namespace {
bool same_op(const pw::ChainStep& a, const pw::ChainStep& b) {
  return a.binary == b.binary && (a.binary ? a.b == b.b : a.u == b.u);
}
std::string op_and_shape(const pw::ChainStep& s, const Shape& shape, DType dtype) {
  std::ostringstream o;
  o << '\'' << pw::chain_op_name(s) << "' " << shape << ' ' << dtype_name(dtype);
  return o.str();
}
}  // namespace

std::string FusedChain::describe() const {
  std::ostringstream o;
  for (std::size_t k = 0; k < links.size(); ++k) o << (k ? " -> " : "") << pw::chain_op_name(links[k].step);
  if (!links.empty()) o << ' ' << links.back().shape << ' ' << dtype_name(links.back().dtype);
  return o.str();
}

std::string FusedPair::describe() const {
  static constexpr const char* producers[] = {"add", "dropout", "linear", ""};
  static constexpr const char* consumers[] = {"layernorm", "add", "gelu_tanh", "softmax"};
  const auto k = static_cast<std::size_t>(kind);
  std::ostringstream o;
  if (kind == fusion::PairKind::scale_masked_softmax) {
    if (scale_operand >= 0) o << (divide ? "div" : "mul") << " -> ";
    if (masked) o << "masked_fill -> ";
  } else {
    o << producers[k] << " -> ";
  }
  o << consumers[k] << ' ' << shape << ' ' << dtype_name(dtype) << " as " << fusion::pair_kind_name(kind);
  return o.str();
}

namespace {
bool pairs_on_every_device() {
  const char* v = std::getenv("TG_FUSE_PAIRS");
  if (!v || !*v) return false;
  const std::string s(v);
  if (s == "all") return true;
  throw Error("TG_FUSE_PAIRS must be 'all' (or unset), got '", s, "'");
}
}  // namespace

FusionScout::FusionScout() : every_device_(pairs_on_every_device()) {}

bool fusable_context() { return autodiff::grad_enabled() && !autodiff::in_backward() && autodiff::region_stack().empty(); }

// ---- finding chains ------------------------------------------------------------------------------------------
int FusionScout::producer_of(const Storage* s) const {
  if (!s) return -1;
  const auto it = produced_.find(s);
  if (it == produced_.end()) return -1;
  const auto alive = events_[static_cast<std::size_t>(it->second)].out.lock();
  return alive.get() == s ? it->second : -1;  // a dead producer's address reused by another storage is not its value
}

fusion::Decision FusionScout::on_op(const pw::ChainStep& step, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
                                    DType dtype, DeviceKind device) {
  list(step, fusion::Special::none, operands, n, out_shape, dtype, device);
  return {};
}

fusion::Decision FusionScout::on_special(fusion::Special op, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
                                         DType dtype, DeviceKind device) {
  list(pw::ChainStep(), op, operands, n, out_shape, dtype, device);
  return {};
}

void FusionScout::list(const pw::ChainStep& step, fusion::Special special, const fusion::OperandInfo* operands, int n,
                       const Shape& out_shape, DType dtype, DeviceKind device) {
  awaiting_ = false;
  if (!fusable_context()) return;
  Event e;
  e.step = step;
  e.special = special;
  e.n = n;
  e.shape = out_shape;
  e.dtype = dtype;
  e.device = device;
  e.recorded_at = recorded_;
  for (int i = 0; i < n; ++i) {
    const fusion::OperandInfo& o = operands[i];
    Operand& in = e.in[i];
    if (o.storage) in.storage = *o.storage;
    in.meta = o.meta;
    in.offset = o.offset;
    in.shape = o.shape;
    in.strides = o.strides;
    in.constant = o.constant && device == DeviceKind::cpu;  // as a constant only when it comes from outside a chain
    in.requires_grad = o.requires_grad;
    const int p = producer_of(o.raw());
    if (p < 0) continue;
    const Event& src = events_[static_cast<std::size_t>(p)];
    // A link's value is that very tensor; another view of it or a detach (which must not carry gradients
    // into the chain) is a read the chain cannot take over.
    if (o.meta == src.out_meta && o.offset == 0 && o.shape == src.shape && o.strides == contiguous_strides(src.shape))
      in.from = p;
    else
      events_[static_cast<std::size_t>(p)].read_elsewhere = true;
  }
  const int me = static_cast<int>(events_.size());
  events_.push_back(std::move(e));
  for (int i = 0; i < n; ++i)
    if (const int p = events_.back().in[i].from; p >= 0) {
      auto& readers = events_[static_cast<std::size_t>(p)].readers;
      if (readers.empty() || readers.back() != me) readers.push_back(me);
    }
  awaiting_ = true;
}

void FusionScout::on_recorded() { ++recorded_; }

void FusionScout::on_io(const std::shared_ptr<Storage>& output, const void* output_meta, std::initializer_list<const Storage*> inputs) {
  if (awaiting_) {  // the record of the fusable op just listed
    awaiting_ = false;
    events_.back().out = output;
    events_.back().out_meta = output_meta;
    if (output) produced_[output.get()] = static_cast<int>(events_.size()) - 1;
    return;
  }
  for (const Storage* s : inputs)
    if (const int p = producer_of(s); p >= 0) events_[static_cast<std::size_t>(p)].read_elsewhere = true;
  if (output) produced_.erase(output.get());
}

std::vector<FusedPair> FusionScout::pairs(std::vector<bool>& taken) const {
  std::vector<FusedPair> out;
  const int n = static_cast<int>(events_.size());
  auto is_add = [](const Event& e) { return e.special == fusion::Special::none && e.step.binary && e.step.b == math::Binary::add && e.n == 2; };
  auto value_only_read_by = [](const Event& p, int reader) {  // never stored once fused: read by its consumer only, gone at the end
    return !p.read_elsewhere && p.out.expired() && p.readers.size() == 1 && p.readers.front() == reader;
  };
  // e's operand that is a one-element scale needing no gradient, its other operand of e's shape (-1: none; a
  // div's scale is its divisor)
  auto scale_of = [](const Event& e) {
    if (e.special != fusion::Special::none || !e.step.binary || e.n != 2 ||
        (e.step.b != math::Binary::mul && e.step.b != math::Binary::div))
      return -1;
    for (int sc = 1; sc >= 0; --sc) {
      if (sc == 0 && e.step.b == math::Binary::div) break;
      if (e.in[sc].shape.numel() == 1 && !e.in[sc].requires_grad && e.in[1 - sc].shape == e.shape) return sc;
    }
    return -1;
  };
  // b follows a directly, of one dtype and device, and reads a's value (that very tensor) as its operand 0 alone
  auto feeds = [&](int a, int b) {
    if (b >= n) return false;
    const Event& p = events_[static_cast<std::size_t>(a)];
    const Event& c = events_[static_cast<std::size_t>(b)];
    bool only = c.in[0].from == a;
    for (int i = 1; i < c.n; ++i) only = only && c.in[i].from != a;
    return c.recorded_at == p.recorded_at + 1 && c.dtype == p.dtype && c.device == p.device && c.shape == p.shape && only &&
           value_only_read_by(p, b);
  };
  for (int k = 0; k + 1 < n; ++k) {
    const Event& p = events_[static_cast<std::size_t>(k)];
    const Event& c = events_[static_cast<std::size_t>(k + 1)];
    if (c.recorded_at != p.recorded_at + 1 || c.dtype != p.dtype || c.device != p.device) continue;
    FusedPair pr;
    bool found = false;
    if (const int sc = scale_of(p); (sc >= 0 || p.special == fusion::Special::masked_fill) && (p.device == DeviceKind::cpu || every_device_)) {
      int last = k;  // the scale, then the mask, then the softmax
      if (sc >= 0 && events_[static_cast<std::size_t>(k + 1)].special == fusion::Special::masked_fill && feeds(k, k + 1)) last = k + 1;
      const int soft = last + 1;
      if (soft < n && events_[static_cast<std::size_t>(soft)].special == fusion::Special::softmax && feeds(last, soft)) {
        pr.kind = fusion::PairKind::scale_masked_softmax;
        pr.length = soft - k + 1;
        pr.scale_operand = sc;
        pr.divide = sc >= 0 && p.step.b == math::Binary::div;
        pr.masked = p.special == fusion::Special::masked_fill || last > k;
        pr.value_operand = 0;
        found = true;
      }
    }
    if (found) {
    } else if (is_add(p) && c.special == fusion::Special::layernorm && c.in[0].from == k && p.in[0].shape == p.shape &&
        p.in[1].shape == p.shape) {
      pr.kind = fusion::PairKind::add_layernorm;
      pr.value_operand = 0;
      found = true;
    } else if (p.special == fusion::Special::dropout && is_add(c) && (c.in[0].from == k) != (c.in[1].from == k) &&
               c.shape == p.shape && value_only_read_by(p, k + 1)) {
      pr.kind = fusion::PairKind::dropout_add;
      pr.value_operand = c.in[0].from == k ? 0 : 1;
      found = c.in[1 - pr.value_operand].shape == p.shape;
    } else if (p.special == fusion::Special::linear && (p.device != DeviceKind::cpu || every_device_) &&
               c.special == fusion::Special::none && !c.step.binary &&
               c.step.u == math::Unary::gelu_tanh && c.in[0].from == k && value_only_read_by(p, k + 1)) {
      pr.kind = fusion::PairKind::linear_gelu_tanh;
      pr.value_operand = 0;
      found = true;
    }
    if (!found) continue;
    pr.first = k;
    pr.shape = p.shape;
    pr.dtype = p.dtype;
    pr.device = p.device;
    pr.producer_operands = p.n;
    std::ostringstream why;
    why << "tg::compile: this tensor is the value of the pair " << pr.describe()
        << (pr.kind == fusion::PairKind::add_layernorm ? ", which the fused op writes when its layernorm runs: it was read before that"
                                                        : ", which the fused op never stores: it was read other than by the pair's consumer")
        << " (Note [pair rewrites]); compile the step with CompileOptions{.fuse = false}";
    pr.message = std::make_shared<const std::string>(why.str());
    for (int i = 0; i < pr.length; ++i) taken[static_cast<std::size_t>(k + i)] = true;
    const int length = pr.length;
    out.push_back(std::move(pr));
    k += length - 1;
  }
  return out;
}

FusionPlan FusionScout::plan() const {
  FusionPlan result;
  std::vector<bool> taken(events_.size(), false);
  result.pairs = pairs(taken);
  std::vector<FusedChain>& chains = result.chains;
  const int n = static_cast<int>(events_.size());
  auto chainable = [&](int k) {
    const Event& e = events_[static_cast<std::size_t>(k)];
    return e.special == fusion::Special::none && !taken[static_cast<std::size_t>(k)];
  };
  int i = 0;
  while (i < n) {
    const Event& head = events_[static_cast<std::size_t>(i)];
    if (!chainable(i)) {
      ++i;
      continue;
    }
    int end = i;
    while (end + 1 < n) {  // the longest run of ops recorded back to back, of one dtype, device and shape
      const Event& a = events_[static_cast<std::size_t>(end)];
      const Event& b = events_[static_cast<std::size_t>(end + 1)];
      if (!chainable(end + 1) || b.recorded_at != a.recorded_at + 1 || b.dtype != head.dtype || b.device != head.device ||
          b.shape != head.shape)
        break;
      ++end;
    }
    if (head.shape.numel() < kMinChainElements) end = i;
    for (bool changed = true; changed && end > i;) {
      changed = false;
      std::vector<const Operand*> ids;  // the limits: inputs, constants, steps
      int constants = 0;
      for (int k = i; k <= end && !changed; ++k) {
        const Event& e = events_[static_cast<std::size_t>(k)];
        for (int o = 0; o < e.n; ++o) {
          const Operand& in = e.in[o];
          if (in.from >= i) continue;
          if (in.constant) {
            ++constants;
          } else {
            if (std::none_of(ids.begin(), ids.end(), [&](const Operand* o) { return o->same(in); })) ids.push_back(&in);
          }
        }
        if (static_cast<int>(ids.size()) > pw::ChainProgram::kMaxInputs || constants > pw::ChainProgram::kMaxConstants ||
            k - i + 1 > pw::ChainProgram::kMaxSteps) {
          end = k - 1;
          changed = true;
        }
      }
      for (int m = i; m < end && !changed; ++m) {  // every value but the last read by later links only, and gone
        const Event& e = events_[static_cast<std::size_t>(m)];
        bool ok = !e.read_elsewhere && e.out.expired() && !e.readers.empty();
        for (int r : e.readers) ok = ok && r > m && r <= end;
        if (!ok) {
          end = m;
          changed = true;
        }
      }
    }
    if (end == i) {
      ++i;
      continue;
    }
    FusedChain c;
    c.first = i;
    for (int k = i; k <= end; ++k) {
      const Event& e = events_[static_cast<std::size_t>(k)];
      ChainLink l;
      l.step = e.step;
      l.shape = e.shape;
      l.dtype = e.dtype;
      l.device = e.device;
      l.operands = e.n;
      for (int o = 0; o < e.n; ++o) {
        l.from[o] = e.in[o].from >= i ? e.in[o].from - i : -1;
        l.constant[o] = e.in[o].from < i && e.in[o].constant;
      }
      c.links.push_back(l);
    }
    for (std::size_t k = 0; k + 1 < c.links.size(); ++k) {
      std::ostringstream why;
      why << "tg::compile: this tensor is the value of " << op_and_shape(c.links[k].step, c.links[k].shape, c.links[k].dtype) << ", link " << k
          << " of the fused chain " << c.describe()
          << ", which is never computed (Note [fusion rewrites]): a step that reads it other than through the chain's own ops "
             "cannot be fused; compile it with CompileOptions{.fuse = false}";
      c.messages.push_back(std::make_shared<const std::string>(why.str()));
    }
    chains.push_back(std::move(c));
    i = end + 1;
  }
  return result;
}

// ---- fusing them ---------------------------------------------------------------------------------------------
void FusionApply::diverged(const std::string& what) const {
  const std::string chain = next_ < chains_->size() ? (*chains_)[next_].describe() : std::string("none");
  throw Error("tg::compile: fusion: ", what, " (fused chain ", next_, ": ", chain,
              "): its ops depend on its data, so its fused chains cannot be replayed; run it without compile");
}

void FusionApply::pair_diverged(const std::string& what) const {
  const std::string pair = next_pair_ < pairs_->size() ? (*pairs_)[next_pair_].describe() : std::string("none");
  throw Error("tg::compile: fusion: ", what, " (fused pair ", next_pair_, ": ", pair,
              "): its ops depend on its data, so its fused pairs cannot be replayed; run it without compile");
}

namespace {
const char* op_name(const pw::ChainStep* step, fusion::Special op) { return step ? pw::chain_op_name(*step) : fusion::special_name(op); }
}  // namespace

fusion::Decision FusionApply::produce(const pw::ChainStep* step, fusion::Special op, const fusion::OperandInfo* operands, int n,
                                      const Shape& out_shape, DType dtype, DeviceKind device) {
  const FusedPair& pr = (*pairs_)[next_pair_];
  bool same = false;
  switch (pr.kind) {
    case fusion::PairKind::add_layernorm:
      same = step && step->binary && step->b == math::Binary::add && n == 2 && operands[0].shape == out_shape && operands[1].shape == out_shape;
      break;
    case fusion::PairKind::dropout_add: same = !step && op == fusion::Special::dropout; break;
    case fusion::PairKind::linear_gelu_tanh: same = !step && op == fusion::Special::linear; break;
    case fusion::PairKind::scale_masked_softmax:
      if (pr.scale_operand < 0) {
        same = !step && op == fusion::Special::masked_fill;
      } else {
        const int sc = pr.scale_operand;
        same = step && step->binary && step->b == (pr.divide ? math::Binary::div : math::Binary::mul) && n == 2;
        if (same && (operands[sc].shape.numel() != 1 || operands[sc].requires_grad || operands[1 - sc].shape != out_shape))
          pair_diverged(std::string("the pair's first op '") + op_name(step, op) + "' " + to_string(out_shape) + ' ' +
                        std::string(dtype_name(dtype)) + " no longer scales by a one-element tensor that needs no gradient (operand " +
                        std::to_string(sc) + ": " + to_string(operands[sc].shape) +
                        (operands[sc].requires_grad ? ", requires a gradient" : "") + ")");
      }
      break;
  }
  if (!same || n != pr.producer_operands || out_shape != pr.shape || dtype != pr.dtype || device != pr.device)
    pair_diverged(std::string("the pair's first op is '") + op_name(step, op) + "' " + to_string(out_shape) + ' ' + std::string(dtype_name(dtype)) +
                  (n == pr.producer_operands ? std::string() : " over " + std::to_string(n) + " operands"));
  pair_ = {};
  pair_.kind = pr.kind;
  pair_.scale_operand = pr.scale_operand;
  pair_.divide = pr.divide;
  pair_open_ = true;
  stage_ = 1;
  fusion::Decision d;
  if (pr.kind == fusion::PairKind::scale_masked_softmax) {
    d.action = pr.scale_operand >= 0 ? fusion::Action::hold : fusion::Action::member;  // a masked_fill keeps x itself
    d.new_input[0] = pr.scale_operand < 0;
    d.pending = Storage::pending(static_cast<std::size_t>(out_shape.numel()) * dtype_size(dtype), pr.message);
    pair_value_ = d.pending;
  } else if (pr.kind == fusion::PairKind::add_layernorm) {
    d.action = fusion::Action::deferred;  // the add records its node; the consumer writes its output
    d.why = pr.message;
    own_record_ = true;
  } else {
    d.action = fusion::Action::member;
    d.pending = Storage::pending(static_cast<std::size_t>(out_shape.numel()) * dtype_size(dtype), pr.message);
    pair_value_ = d.pending;
  }
  return d;
}

fusion::Decision FusionApply::consume(const pw::ChainStep* step, fusion::Special op, const fusion::OperandInfo* operands, int n,
                                      const Shape& out_shape, DType dtype, DeviceKind device) {
  const FusedPair& pr = (*pairs_)[next_pair_];
  const bool middle = stage_ < pr.length - 1;  // a scale_masked_softmax's masked_fill
  bool same = false;
  switch (pr.kind) {
    case fusion::PairKind::scale_masked_softmax:
      same = !step && op == (middle ? fusion::Special::masked_fill : fusion::Special::softmax);
      break;
    case fusion::PairKind::add_layernorm: same = !step && op == fusion::Special::layernorm; break;
    case fusion::PairKind::dropout_add: same = step && step->binary && step->b == math::Binary::add && n == 2; break;
    case fusion::PairKind::linear_gelu_tanh: same = step && !step->binary && step->u == math::Unary::gelu_tanh; break;
  }
  if (!same || out_shape != pr.shape || dtype != pr.dtype || device != pr.device)
    pair_diverged(std::string("'") + op_name(step, op) + "' " + to_string(out_shape) + ' ' + std::string(dtype_name(dtype)) +
                  " ran right after the pair's " + (stage_ > 1 ? "middle" : "first") + " op where the captured step ran its " +
                  (middle ? "masked_fill" : "consumer"));
  const Storage* value = pr.kind == fusion::PairKind::add_layernorm ? pair_.filled.get() : pair_value_.get();
  auto is_value = [&](const fusion::OperandInfo& o) {
    return value && o.raw() == value && o.offset == 0 && o.shape == pr.shape && o.strides == contiguous_strides(pr.shape);
  };
  const int v = pr.value_operand;
  bool wired = v < n && is_value(operands[v]);
  for (int i = 0; i < n; ++i)
    if (i != v && is_value(operands[i])) wired = false;
  if (pr.kind == fusion::PairKind::dropout_add && wired) wired = operands[1 - v].shape == pr.shape;
  if (!wired)
    pair_diverged(std::string("the pair's ") + (middle ? "middle op '" : "consumer '") + op_name(step, op) +
                  "' does not read the value of its " + (stage_ > 1 ? "middle" : "first") + " op as operand " + std::to_string(v) +
                  " alone, as the captured step did");
  if (middle) {  // the masked_fill: its value is pending too; the softmax comes next
    ++stage_;
    fusion::Decision d;
    d.action = fusion::Action::member;
    d.pending = Storage::pending(static_cast<std::size_t>(out_shape.numel()) * dtype_size(dtype), pr.message);
    pair_value_ = d.pending;
    return d;
  }
  pair_open_ = false;
  own_record_ = false;
  pair_running_ = true;
  ++next_pair_;
  fusion::Decision d;
  d.action = fusion::Action::consume;
  d.value_operand = v;
  return d;
}

fusion::Decision FusionApply::on_special(fusion::Special op, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
                                         DType dtype, DeviceKind device) {
  if (!fusable_context()) {
    if (open_) diverged(std::string("'") + fusion::special_name(op) + "' ran between two links where it cannot be fused");
    if (pair_open_) pair_diverged(std::string("'") + fusion::special_name(op) + "' ran between the pair's ops");
    return {};
  }
  const std::int64_t ordinal = ordinal_++;
  if (open_) diverged(std::string("'") + fusion::special_name(op) + "' ran between two links");
  if (pair_open_) return consume(nullptr, op, operands, n, out_shape, dtype, device);
  if (next_pair_ < pairs_->size() && (*pairs_)[next_pair_].first == ordinal) return produce(nullptr, op, operands, n, out_shape, dtype, device);
  return {};
}

fusion::Decision FusionApply::on_op(const pw::ChainStep& step, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
                                    DType dtype, DeviceKind device) {
  if (!fusable_context()) {
    if (open_) diverged(op_and_shape(step, out_shape, dtype) + " ran between two links where it cannot be fused");
    if (pair_open_) pair_diverged(op_and_shape(step, out_shape, dtype) + " ran between the pair's ops");
    return {};
  }
  const std::int64_t ordinal = ordinal_++;
  if (pair_open_) return consume(&step, fusion::Special::none, operands, n, out_shape, dtype, device);
  if (!open_) {
    if (next_pair_ < pairs_->size() && (*pairs_)[next_pair_].first == ordinal)
      return produce(&step, fusion::Special::none, operands, n, out_shape, dtype, device);
    if (next_ >= chains_->size() || (*chains_)[next_].first != ordinal) return {};
    open_ = true;
    link_ = 0;
    pending_.clear();
    refs_.clear();
    input_ids_.clear();
    inputs_.clear();
    program_ = {};
  }
  const FusedChain& chain = (*chains_)[next_];
  const ChainLink& link = chain.links[link_];
  if (!same_op(step, link.step) || out_shape != link.shape || dtype != link.dtype || device != link.device || n != link.operands)
    diverged("link " + std::to_string(link_) + " is " + op_and_shape(step, out_shape, dtype) + " where the captured step ran " +
             op_and_shape(link.step, link.shape, link.dtype));
  fusion::Decision d;
  std::array<Ref, 2> refs{Ref{'x', 0}, Ref{'x', 0}};
  for (int i = 0; i < n; ++i) {
    const fusion::OperandInfo& o = operands[i];
    int from = -1;  // a link's value: its pending storage, as that link returned it
    for (std::size_t k = 0; k < pending_.size(); ++k)
      if (pending_[k].get() == o.raw() && o.offset == 0 && o.shape == chain.links[k].shape && o.strides == contiguous_strides(o.shape))
        from = static_cast<int>(k);
    const bool constant = from < 0 && o.constant;
    if (from != link.from[i] || constant != link.constant[i])
      diverged("operand " + std::to_string(i) + " of link " + std::to_string(link_) + " (" + pw::chain_op_name(step) + ") is " +
               (from >= 0 ? "link " + std::to_string(from) + "'s value" : constant ? std::string("a constant") : std::string("an input")) +
               " where the captured step read " +
               (link.from[i] >= 0 ? "link " + std::to_string(link.from[i]) + "'s value"
                                  : link.constant[i] ? std::string("a constant") : std::string("an input")));
    if (from >= 0) {
      refs[static_cast<std::size_t>(i)] = {'t', from};
    } else if (constant) {
      program_.constants.push_back(o.value);
      refs[static_cast<std::size_t>(i)] = {'c', static_cast<int>(program_.constants.size()) - 1};
    } else {
      const InputId id{o.raw(), o.meta, o.offset, o.shape, o.strides};
      auto it = std::find(input_ids_.begin(), input_ids_.end(), id);
      if (it == input_ids_.end()) {
        input_ids_.push_back(id);
        it = input_ids_.end() - 1;
        d.new_input[static_cast<std::size_t>(i)] = true;
      }
      refs[static_cast<std::size_t>(i)] = {'x', static_cast<int>(it - input_ids_.begin())};
    }
  }
  refs_.push_back(refs);
  pw::ChainStep s = step;
  program_.steps.push_back(s);
  if (++link_ < chain.links.size()) {
    d.action = fusion::Action::member;
    d.pending = Storage::pending(static_cast<std::size_t>(out_shape.numel()) * dtype_size(dtype), chain.messages[link_ - 1]);
    pending_.push_back(d.pending);
    return d;
  }
  // the tail: the slots are known now (inputs, then constants, then the links' values)
  program_.inputs = static_cast<int>(input_ids_.size());
  const int constants = static_cast<int>(program_.constants.size());
  auto slot = [&](const Ref& r) { return r.kind == 'x' ? r.index : r.kind == 'c' ? program_.inputs + r.index : program_.inputs + constants + r.index; };
  for (std::size_t k = 0; k < program_.steps.size(); ++k) {
    program_.steps[k].a = slot(refs_[k][0]);
    program_.steps[k].c = program_.steps[k].binary ? slot(refs_[k][1]) : 0;
  }
  out_shape_ = out_shape;
  open_ = false;
  d.action = fusion::Action::tail;
  return d;
}

void FusionApply::done() {
  if (pair_running_) {
    pair_running_ = false;
    pair_ = {};
    pair_value_.reset();
    return;
  }
  ++next_;
  pending_.clear();
  inputs_.clear();
  input_ids_.clear();
}

void FusionApply::on_recorded(const char* op) {
  if (pair_open_) {
    if (own_record_) {  // the deferred add's own node
      own_record_ = false;
      return;
    }
    pair_diverged(std::string("op '") + op + "' was recorded between the pair's ops");
  }
  if (open_) diverged(std::string("op '") + op + "' was recorded between links " + std::to_string(link_ - 1) + " and " + std::to_string(link_));
}

void FusionApply::finish() const {
  if (pair_open_) pair_diverged(std::string("the step ended after the pair's ") + (stage_ > 1 ? "middle" : "first") + " op");
  if (pair_running_) pair_diverged("the pair's fused op did not finish");
  if (next_pair_ != pairs_->size())
    throw Error("tg::compile: fusion: the step ran ", next_pair_, " of the ", pairs_->size(), " fused pairs it was captured with (the next one: ",
                (*pairs_)[next_pair_].describe(), "): its ops depend on its data, so it cannot be replayed; run it without compile");
  if (open_) diverged("the step ended after link " + std::to_string(link_ - 1));
  if (next_ != chains_->size())
    throw Error("tg::compile: fusion: the step ran ", next_, " of the ", chains_->size(), " fused chains it was captured with (the next one: ",
                (*chains_)[next_].describe(), "): its ops depend on its data, so it cannot be replayed; run it without compile");
}

}  // namespace capture

namespace fusion {
const char* pair_kind_name(PairKind k) {
  switch (k) {
    case PairKind::add_layernorm: return "add_layernorm";
    case PairKind::dropout_add: return "dropout_add";
    case PairKind::linear_gelu_tanh: return "linear_gelu_tanh";
    case PairKind::scale_masked_softmax: return "scale_masked_softmax";
  }
  return "?";
}
const char* special_name(Special op) {
  switch (op) {
    case Special::none: return "elementwise";
    case Special::dropout: return "dropout";
    case Special::linear: return "linear";
    case Special::layernorm: return "layernorm";
    case Special::masked_fill: return "masked_fill";
    case Special::softmax: return "softmax";
  }
  return "?";
}
}  // namespace fusion
}  // namespace tg

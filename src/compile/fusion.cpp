// tg::compile's fusion rewrite: finding chains of elementwise ops and fusing them (Note [fusion rewrites]).
#include "typegrad/compile/fusion.hpp"

#include <algorithm>
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
  awaiting_ = false;
  if (!fusable_context()) return {};
  Event e;
  e.step = step;
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
  return {};
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

std::vector<FusedChain> FusionScout::plan() const {
  std::vector<FusedChain> chains;
  const int n = static_cast<int>(events_.size());
  int i = 0;
  while (i < n) {
    const Event& head = events_[static_cast<std::size_t>(i)];
    int end = i;
    while (end + 1 < n) {  // the longest run of ops recorded back to back, of one dtype, device and shape
      const Event& a = events_[static_cast<std::size_t>(end)];
      const Event& b = events_[static_cast<std::size_t>(end + 1)];
      if (b.recorded_at != a.recorded_at + 1 || b.dtype != head.dtype || b.device != head.device || b.shape != head.shape) break;
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
  return chains;
}

// ---- fusing them ---------------------------------------------------------------------------------------------
void FusionApply::diverged(const std::string& what) const {
  const std::string chain = next_ < chains_->size() ? (*chains_)[next_].describe() : std::string("none");
  throw Error("tg::compile: fusion: ", what, " (fused chain ", next_, ": ", chain,
              "): its ops depend on its data, so its fused chains cannot be replayed; run it without compile");
}

fusion::Decision FusionApply::on_op(const pw::ChainStep& step, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
                                    DType dtype, DeviceKind device) {
  if (!fusable_context()) {
    if (open_) diverged(op_and_shape(step, out_shape, dtype) + " ran between two links where it cannot be fused");
    return {};
  }
  const std::int64_t ordinal = ordinal_++;
  if (!open_) {
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
  running_ = true;
  d.action = fusion::Action::tail;
  return d;
}

void FusionApply::done() {
  running_ = false;
  ++next_;
  pending_.clear();
  inputs_.clear();
  input_ids_.clear();
}

void FusionApply::on_recorded(const char* op) {
  if (open_) diverged(std::string("op '") + op + "' was recorded between links " + std::to_string(link_ - 1) + " and " + std::to_string(link_));
}

void FusionApply::finish() const {
  if (open_) diverged("the step ended after link " + std::to_string(link_ - 1));
  if (next_ != chains_->size())
    throw Error("tg::compile: fusion: the step ran ", next_, " of the ", chains_->size(), " fused chains it was captured with (the next one: ",
                (*chains_)[next_].describe(), "): its ops depend on its data, so it cannot be replayed; run it without compile");
}

}  // namespace capture
}  // namespace tg

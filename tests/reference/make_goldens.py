#!/usr/bin/python3
"""Golden inputs, outputs and gradients from PyTorch (fp32, CPU) for typegrad's parity test.

    /usr/bin/python3 tests/reference/make_goldens.py --out tests/reference/goldens          # fixed seed
    /usr/bin/python3 tests/reference/make_goldens.py --seed time --out build/cpu/fresh      # fresh seed, printed

One file per op (<op>.tgg) plus gpt.tgg for a small GPT-style stack, in the format of FORMAT.md.
Each op case stores its inputs x<k> (f32), index inputs idx<k> (i64), op parameters `args` (f64),
the layout each input gets on the C++ side (`layout`, i64: 0 contiguous, 1 transposed last two dims,
2 every other element of a twice-as-long last dim), the output `out`, a random upstream `u`, and the
gradients dx<k> of sum(out * u) for the differentiable inputs. Record names are "<case>/<field>".

Inputs are drawn with numpy from a generator keyed by (seed, op, case), so adding a case or an op
leaves every other record unchanged. The semantics of `args` for each op are spelled out next to the
op below; tests/reference/test_parity.cpp reads them the same way.
"""
import argparse
import math
import os
import struct
import sys
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F

MAGIC = b"TGGOLD01"
DTYPES = {np.dtype(np.float32): 1, np.dtype(np.int64): 2, np.dtype(np.float64): 3}
DEFAULT_SEED = 20240611


# ---- the file format (FORMAT.md) -------------------------------------------------------------------
def write_golden(path, records):
    """records: list of (name, numpy array). Little-endian throughout."""
    out = bytearray(MAGIC)
    out += struct.pack("<I", len(records))
    for name, arr in records:
        arr = np.array(arr, order="C", copy=True)  # (ascontiguousarray would turn rank 0 into rank 1)
        code = DTYPES[arr.dtype]
        nb = name.encode("utf-8")
        out += struct.pack("<I", len(nb)) + nb
        out += struct.pack("<BI", code, arr.ndim)
        out += struct.pack("<%dq" % arr.ndim, *arr.shape)
        out += arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    with open(path, "wb") as f:
        f.write(out)


# ---- op cases --------------------------------------------------------------------------------------
class Fl:
    """A float32 input, uniform in [lo, hi)."""

    def __init__(self, *shape, lo=-2.0, hi=2.0, grad=True, layout=0):
        self.shape, self.lo, self.hi, self.grad, self.layout = shape, lo, hi, grad, layout


class Ix:
    """An int64 input, uniform in [lo, hi); `set` overrides chosen flat positions (e.g. ignore_index)."""

    def __init__(self, *shape, lo=0, hi=1, set=None):
        self.shape, self.lo, self.hi, self.set = shape, lo, hi, set or {}


class OpGoldens:
    def __init__(self, op, seed):
        self.op, self.seed, self.records = op, seed, []

    def case(self, name, inputs, fn, args=()):
        """fn(args, *float_tensors, *index_tensors) -> output tensor."""
        rng = np.random.default_rng([self.seed, zlib.crc32(("%s/%s" % (self.op, name)).encode())])
        xs, idx, layout = [], [], []
        for spec in inputs:
            if isinstance(spec, Fl):
                a = rng.uniform(spec.lo, spec.hi, size=spec.shape).astype(np.float32)
                xs.append((a, spec))
                layout.append(spec.layout)
            else:
                a = rng.integers(spec.lo, spec.hi, size=spec.shape, dtype=np.int64)
                for pos, v in spec.set.items():
                    a.reshape(-1)[pos] = v
                idx.append(a)
        ts = [torch.tensor(a, requires_grad=s.grad) for a, s in xs]
        its = [torch.tensor(a) for a in idx]
        out = fn(list(args), *ts, *its)
        u = rng.uniform(-1.0, 1.0, size=tuple(out.shape)).astype(np.float32)
        if any(s.grad for _, s in xs):
            (out * torch.tensor(u)).sum().backward()
        p = name + "/"
        for k, (a, _) in enumerate(xs):
            self.records.append((p + "x%d" % k, a))
        for k, a in enumerate(idx):
            self.records.append((p + "idx%d" % k, a))
        self.records.append((p + "args", np.array(args, dtype=np.float64)))
        self.records.append((p + "layout", np.array(layout, dtype=np.int64)))
        self.records.append((p + "out", out.detach().numpy().astype(np.float32)))
        self.records.append((p + "u", u))
        for k, (t, (_, s)) in enumerate(zip(ts, xs)):
            if s.grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self.records.append((p + "dx%d" % k, g.numpy()))


OPS = {}
PENDING = set()  # ops whose typegrad side is not there yet: generated only when named with --ops


def op(name, pending=False):
    def deco(f):
        OPS[name] = f
        if pending:
            PENDING.add(name)
        return f
    return deco


def binary_cases(g, f, lo_b=-2.0, hi_b=2.0):
    g.case("same_shape", [Fl(3, 5), Fl(3, 5, lo=lo_b, hi=hi_b)], lambda a, x, y: f(x, y))
    g.case("broadcast", [Fl(4, 1, 5), Fl(3, 1, lo=lo_b, hi=hi_b)], lambda a, x, y: f(x, y))
    g.case("row", [Fl(2, 3, 7), Fl(7, lo=lo_b, hi=hi_b)], lambda a, x, y: f(x, y))
    g.case("noncontiguous", [Fl(6, 5, layout=1), Fl(6, 5, lo=lo_b, hi=hi_b, layout=2)], lambda a, x, y: f(x, y))


@op("add")
def _(g):
    binary_cases(g, torch.add)


@op("sub")
def _(g):
    binary_cases(g, torch.sub)


@op("mul")
def _(g):
    binary_cases(g, torch.mul)


@op("div")
def _(g):
    binary_cases(g, torch.div, 0.5, 2.0)


@op("neg")
def _(g):
    g.case("matrix", [Fl(3, 4)], lambda a, x: -x)
    g.case("strided", [Fl(2, 3, 5, layout=2)], lambda a, x: -x)


@op("scalar_arith")
def _(g):
    # (2 - x*3) / 4 + 1, scalars on both sides
    g.case("matrix", [Fl(3, 4)], lambda a, x: (2.0 - x * 3.0) / 4.0 + 1.0)


# sum / mean: args = [keepdim, dims...]; no dims = all dims
def reduce_cases(g, f):
    def call(a, x):
        keep, dims = bool(a[0]), [int(d) for d in a[1:]]
        return f(x) if not dims else f(x, dim=dims, keepdim=keep)
    g.case("all", [Fl(3, 5)], call, args=[0])
    g.case("last_dim", [Fl(4, 7)], call, args=[0, -1])
    g.case("first_keepdim", [Fl(5, 3, 2)], call, args=[1, 0])
    g.case("two_dims_transposed", [Fl(3, 4, 5, layout=1)], call, args=[0, 0, 2])


@op("sum")
def _(g):
    reduce_cases(g, torch.sum)


@op("mean")
def _(g):
    reduce_cases(g, torch.mean)


# max: args = [dim, keepdim]
@op("max")
def _(g):
    call = lambda a, x: torch.max(x, dim=int(a[0]), keepdim=bool(a[1])).values
    g.case("last_dim", [Fl(4, 7)], call, args=[-1, 0])
    g.case("first_keepdim", [Fl(5, 3, layout=1)], call, args=[0, 1])
    g.case("middle", [Fl(2, 9, 3)], call, args=[1, 0])


# ---- views (the C++ side multiplies by 1 where needed so the output owns its data) ----
@op("reshape")
def _(g):
    # args = target shape
    call = lambda a, x: x.reshape([int(d) for d in a])
    g.case("view", [Fl(3, 10)], call, args=[5, -1])
    g.case("copy_of_transposed", [Fl(5, 6, layout=1)], call, args=[2, 15])


@op("transpose")
def _(g):
    # args = [d0, d1]
    call = lambda a, x: x.transpose(int(a[0]), int(a[1]))
    g.case("rank3", [Fl(2, 3, 4)], call, args=[0, 2])
    g.case("strided", [Fl(2, 3, 5, layout=2)], call, args=[-1, 1])


@op("permute")
def _(g):
    call = lambda a, x: x.permute([int(d) for d in a])
    g.case("rank3", [Fl(2, 3, 4)], call, args=[1, 2, 0])
    g.case("rank4_transposed", [Fl(2, 3, 2, 5, layout=1)], call, args=[3, 0, 2, 1])


@op("slice")
def _(g):
    # args = [dim, start, end, step]; torch spells it with indexing
    def call(a, x):
        d, s, e, st = (int(v) for v in a)
        ix = [slice(None)] * x.dim()
        ix[d] = slice(s, e, st)
        return x[tuple(ix)]
    g.case("rows_step2", [Fl(7, 3)], call, args=[0, 1, 6, 2])
    g.case("negative_cols", [Fl(4, 9, layout=1)], call, args=[1, -5, -1, 1])
    g.case("clamped", [Fl(5, 4)], call, args=[0, 2, 100, 1])


@op("narrow")
def _(g):
    call = lambda a, x: x.narrow(int(a[0]), int(a[1]), int(a[2]))
    g.case("cols", [Fl(4, 7)], call, args=[1, 2, 3])
    g.case("rows_strided", [Fl(6, 3, layout=2)], call, args=[0, 1, 4])


@op("expand")
def _(g):
    call = lambda a, x: x.expand([int(d) for d in a])
    g.case("broadcast", [Fl(4, 1)], call, args=[2, 4, 3])
    g.case("keep_minus_one", [Fl(1, 3)], call, args=[5, -1])


@op("squeeze_unsqueeze")
def _(g):
    # args = [squeeze dim, unsqueeze dim]
    call = lambda a, x: x.squeeze(int(a[0])).unsqueeze(int(a[1]))
    g.case("middle", [Fl(3, 1, 4)], call, args=[1, 0])
    g.case("last", [Fl(2, 5, 1)], call, args=[-1, 2])


@op("contiguous")
def _(g):
    g.case("transposed", [Fl(4, 6, layout=1)], lambda a, x: x.contiguous())
    g.case("strided_clone", [Fl(3, 5, layout=2)], lambda a, x: x.clone())


@op("to")
def _(g):
    # args = [code]: 0 fp32 -> fp64 -> fp32, 1 via bf16, 2 via fp16
    def call(a, x):
        via = {0: torch.float64, 1: torch.bfloat16, 2: torch.float16}[int(a[0])]
        return x.to(via).to(torch.float32)
    g.case("via_fp64", [Fl(3, 4)], call, args=[0])
    g.case("via_bf16", [Fl(3, 4)], call, args=[1])
    g.case("via_fp16", [Fl(3, 4)], call, args=[2])


# ---- ops added with the transformer layers ----------------------------------------------------------
# (An op can be registered with pending=True while its typegrad side is missing.)
@op("gelu_tanh")
def _(g):
    call = lambda a, x: F.gelu(x, approximate="tanh")
    g.case("matrix", [Fl(3, 7, lo=-4, hi=4)], call)
    g.case("strided", [Fl(2, 3, 5, lo=-4, hi=4, layout=2)], call)


@op("gelu")
def _(g):
    call = lambda a, x: F.gelu(x)  # exact: x·Φ(x)
    g.case("matrix", [Fl(3, 7, lo=-4, hi=4)], call)
    g.case("transposed", [Fl(4, 6, lo=-4, hi=4, layout=1)], call)


def unary_cases(g, f, lo=-2.0, hi=2.0):
    g.case("matrix", [Fl(3, 7, lo=lo, hi=hi)], lambda a, x: f(x))
    g.case("strided", [Fl(2, 3, 5, lo=lo, hi=hi, layout=2)], lambda a, x: f(x))
    g.case("transposed", [Fl(4, 6, lo=lo, hi=hi, layout=1)], lambda a, x: f(x))


@op("exp")
def _(g):
    unary_cases(g, torch.exp)


@op("log")
def _(g):
    unary_cases(g, torch.log, 0.1, 3.0)


@op("sqrt")
def _(g):
    unary_cases(g, torch.sqrt, 0.1, 3.0)


@op("rsqrt")
def _(g):
    unary_cases(g, torch.rsqrt, 0.1, 3.0)


@op("tanh")
def _(g):
    unary_cases(g, torch.tanh, -3.0, 3.0)


@op("sigmoid")
def _(g):
    unary_cases(g, torch.sigmoid, -4.0, 4.0)


@op("relu")
def _(g):
    unary_cases(g, F.relu)


@op("silu")
def _(g):
    unary_cases(g, F.silu, -4.0, 4.0)


# masked_fill(x, uint8 mask (idx0, broadcastable), value): args = [value]
@op("masked_fill")
def _(g):
    call = lambda a, x, m: x.masked_fill(m.bool(), a[0])
    g.case("same_shape", [Fl(3, 5), Ix(3, 5, lo=0, hi=2)], call, args=[-3.5])
    g.case("broadcast_mask", [Fl(4, 3, 5, layout=1), Ix(1, 5, lo=0, hi=2)], call, args=[0.25])
    g.case("causal_minus_inf", [Fl(2, 4, 4), Ix(4, 4, set={1: 1, 2: 1, 3: 1, 6: 1, 7: 1, 11: 1})], call,
           args=[float("-inf")])


# dropout in eval mode (training=False) is the identity; training mode draws from typegrad's Philox
# stream, which cannot match PyTorch's generator, so it has no golden. args = [p]
@op("dropout_eval")
def _(g):
    g.case("matrix", [Fl(4, 6)], lambda a, x: F.dropout(x, a[0], training=False), args=[0.3])


# concat(xs, dim): args = [dim]
@op("concat")
def _(g):
    call = lambda a, *xs: torch.cat(xs, dim=int(a[0]))
    g.case("three_rows", [Fl(2, 3), Fl(4, 3), Fl(1, 3)], call, args=[0])
    g.case("middle_mixed_layouts", [Fl(2, 3, 4), Fl(2, 5, 4, layout=1)], call, args=[1])
    g.case("last_strided", [Fl(3, 2, layout=2), Fl(3, 4)], call, args=[-1])


# split(x, sizes or chunk, dim); the pieces, scaled by 1, 2, 3, ..., are concatenated back so that
# every piece gets its own upstream gradient. args = [dim, mode (0 sizes, 1 chunk), values...]
@op("split")
def _(g):
    def call(a, x):
        dim, mode, vals = int(a[0]), int(a[1]), [int(v) for v in a[2:]]
        pieces = torch.split(x, vals if mode == 0 else vals[0], dim=dim)
        return torch.cat([p * float(k + 1) for k, p in enumerate(pieces)], dim=dim)
    g.case("sizes", [Fl(3, 6)], call, args=[1, 0, 2, 3, 1])
    g.case("chunk_uneven", [Fl(5, 4, layout=1)], call, args=[0, 1, 2])


# softmax / log_softmax: args = [dim]
@op("softmax")
def _(g):
    call = lambda a, x: F.softmax(x, dim=int(a[0]))
    g.case("last_dim", [Fl(4, 7, lo=-4, hi=4)], call, args=[-1])
    g.case("middle_dim", [Fl(3, 5, 4, lo=-4, hi=4)], call, args=[1])
    g.case("transposed", [Fl(6, 5, lo=-4, hi=4, layout=1)], call, args=[-1])


@op("log_softmax")
def _(g):
    call = lambda a, x: F.log_softmax(x, dim=int(a[0]))
    g.case("last_dim", [Fl(4, 7, lo=-4, hi=4)], call, args=[-1])
    g.case("first_dim", [Fl(5, 3, lo=-4, hi=4)], call, args=[0])
    g.case("strided", [Fl(3, 6, lo=-4, hi=4, layout=2)], call, args=[-1])


# layernorm(x, weight, bias, eps) over the last dim: args = [eps]
@op("layernorm")
def _(g):
    call = lambda a, x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, a[0])
    g.case("rank3", [Fl(2, 3, 8), Fl(8, lo=0.5, hi=1.5), Fl(8)], call, args=[1e-5])
    g.case("transposed", [Fl(5, 16, layout=1), Fl(16, lo=0.5, hi=1.5), Fl(16)], call, args=[1e-5])


# rmsnorm(x, weight, eps) over the last dim: x / sqrt(mean(x²) + eps) · w; args = [eps]
@op("rmsnorm")
def _(g):
    call = lambda a, x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a[0]) * w
    g.case("rank3", [Fl(2, 3, 8), Fl(8, lo=0.5, hi=1.5)], call, args=[1e-6])
    g.case("strided", [Fl(5, 12, layout=2), Fl(12, lo=0.5, hi=1.5)], call, args=[1e-5])


# embedding(weight, idx)
@op("embedding")
def _(g):
    call = lambda a, w, i: F.embedding(i, w)
    g.case("batch", [Fl(11, 6), Ix(2, 5, lo=0, hi=11)], call)
    g.case("repeated_rows", [Fl(4, 5), Ix(13, lo=0, hi=4)], call)


# cross_entropy(logits (N,V), targets (N), ignore_index), mean over the non-ignored: args = [ignore_index]
@op("cross_entropy")
def _(g):
    call = lambda a, x, t: F.cross_entropy(x, t, ignore_index=int(a[0]))
    g.case("plain", [Fl(6, 9, lo=-3, hi=3), Ix(6, lo=0, hi=9)], call, args=[-100])
    g.case("ignore_index", [Fl(7, 5, lo=-3, hi=3), Ix(7, lo=0, hi=5, set={1: -1, 4: -1})], call, args=[-1])
    # (B,T,V) logits with (B,T) targets: torch wants the class dim second, typegrad last
    call3 = lambda a, x, t: F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1), ignore_index=int(a[0]))
    g.case("batch_time", [Fl(2, 3, 6, lo=-3, hi=3), Ix(2, 3, lo=0, hi=6, set={5: -100})], call3, args=[-100])


@op("matmul")
def _(g):
    call = lambda a, x, y: torch.matmul(x, y)
    g.case("matrix", [Fl(3, 4), Fl(4, 5)], call)
    g.case("batched", [Fl(2, 3, 4), Fl(2, 4, 5)], call)
    g.case("broadcast_batch", [Fl(2, 1, 3, 4), Fl(3, 4, 5)], call)
    g.case("vector_matrix", [Fl(4), Fl(4, 5)], call)
    g.case("batch_matrix_vector", [Fl(2, 3, 4), Fl(4)], call)
    g.case("transposed_b", [Fl(5, 6), Fl(6, 3, layout=1)], call)


# linear(x, weight [out,in], bias [out]): args = [has_bias]
@op("linear")
def _(g):
    g.case("bias", [Fl(2, 3, 5), Fl(4, 5), Fl(4)], lambda a, x, w, b: F.linear(x, w, b), args=[1])
    g.case("no_bias", [Fl(7, 6), Fl(3, 6)], lambda a, x, w: F.linear(x, w), args=[0])


# linear_gelu_tanh(x, weight [out,in], bias [out]) = gelu(linear(x, weight, bias), approximate="tanh"):
# args = [has_bias]
@op("linear_gelu_tanh")
def _(g):
    gl = lambda t: F.gelu(t, approximate="tanh")
    g.case("bias", [Fl(2, 3, 5), Fl(16, 5), Fl(16)], lambda a, x, w, b: gl(F.linear(x, w, b)), args=[1])
    g.case("no_bias", [Fl(7, 6), Fl(3, 6)], lambda a, x, w: gl(F.linear(x, w)), args=[0])
    g.case("transposed_x", [Fl(6, 4, layout=1), Fl(8, 4), Fl(8)], lambda a, x, w, b: gl(F.linear(x, w, b)), args=[1])


# causal_attention(q, k, v), each (B,H,T,hs): softmax(q·kᵀ/√hs + causal mask)·v
@op("causal_attention")
def _(g):
    def call(a, q, k, v):
        T, hs = q.shape[-2], q.shape[-1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        return F.softmax(att, dim=-1) @ v
    g.case("heads", [Fl(2, 3, 5, 4), Fl(2, 3, 5, 4), Fl(2, 3, 5, 4)], call)
    g.case("one_head", [Fl(1, 1, 7, 6), Fl(1, 1, 7, 6), Fl(1, 1, 7, 6)], call)
    g.case("longer", [Fl(1, 2, 11, 4), Fl(1, 2, 11, 4), Fl(1, 2, 11, 4)], call)


# attention_composite: the same attention built from matmul, masked_fill and softmax
OPS["attention_composite"] = OPS["causal_attention"]


# rope(x (..., T, Dh), theta, offset, rotary_dim): rotary embeddings, "rotate half" pairs (i, i + R/2) of the
# first R features at positions offset + t, angle (offset + t) · theta^(-2i/R) in fp64; args = [theta,
# offset, rotary_dim (-1: Dh)]. The C++ side is the op database entry (tests/ops/db_rope.cpp).
@op("rope")
def _(g):
    def call(a, x):
        T, Dh = x.shape[-2], x.shape[-1]
        R = Dh if a[2] < 0 else int(a[2])
        h = R // 2
        ang = torch.arange(a[1], a[1] + T, dtype=torch.float64)[:, None] * a[0] ** (-2.0 * torch.arange(h, dtype=torch.float64) / R)
        c, s = torch.cos(ang).float(), torch.sin(ang).float()
        x1, x2 = x[..., :h], x[..., h:R]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)
    g.case("bhtd", [Fl(2, 3, 5, 8)], call, args=[10000, 0, -1])
    g.case("offset_transposed", [Fl(1, 2, 6, 4, layout=1)], call, args=[10000, 11, -1])
    g.case("partial_strided", [Fl(2, 2, 4, 10, layout=2)], call, args=[500, 3, 6])


# swiglu(x (..., 2N)): a, b = x.chunk(2, -1); silu(a) · b (the first half is gated). C++: tests/ops/db_swiglu.cpp.
@op("swiglu")
def _(g):
    call = lambda a, x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]
    g.case("rank3", [Fl(2, 3, 10)], call)
    g.case("transposed", [Fl(6, 4, layout=1)], call)


# kl_div(input = log q (..., V), target = log p (..., V)): Σ exp(t)·(t − x) over the R = numel / V rows,
# divided by R (batchmean over the flattened rows). args = [from_logits]: 1 log_softmax's both inputs over the
# last dim first (the distillation use), 0 applies the op to the raw values. C++: tests/ops/db_kl_div.cpp.
@op("kl_div")
def _(g):
    def call(a, x, t):
        V = x.shape[-1]
        if a[0]:
            x, t = F.log_softmax(x, -1), F.log_softmax(t, -1)
        return F.kl_div(x.reshape(-1, V), t.reshape(-1, V), reduction="batchmean", log_target=True)
    g.case("rows", [Fl(5, 9, lo=-3, hi=3), Fl(5, 9, lo=-3, hi=3)], call, args=[1])
    g.case("rank3", [Fl(2, 3, 7, lo=-3, hi=3), Fl(2, 3, 7, lo=-3, hi=3)], call, args=[1])
    g.case("one_dim", [Fl(11, lo=-3, hi=3), Fl(11, lo=-3, hi=3)], call, args=[1])
    g.case("transposed_teacher_constant", [Fl(6, 5, lo=-3, hi=3, layout=1), Fl(6, 5, lo=-3, hi=3, grad=False)], call,
           args=[1])
    g.case("raw_strided", [Fl(3, 8, lo=-4, hi=0.5, layout=2), Fl(3, 8, lo=-4, hi=0.5)], call, args=[0])


# ---- the GPT stack ---------------------------------------------------------------------------------
GPT_CFG = dict(V=37, C=24, H=3, T=9, B=2, L=2, eps=1e-5, ignore_index=-1)


def reference_gpt_logits(P, idx, L, H, eps=1e-5):
    """The reference GPT-2 forward: P maps GPT-2 names to tensors (nn.Linear layout), idx (B,T) int64;
    returns the logits (B,T,V) of the tied LM head. Also used by tests/io/safetensors_interop.py."""
    B, T = idx.shape
    C = P["wte.weight"].shape[1]
    x = P["wte.weight"][idx] + P["wpe.weight"][torch.arange(T)]  # (B,T,C)
    hs = C // H
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(L):
        p = "h.%d." % i
        h = F.layer_norm(x, (C,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        qkv = F.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])  # (B,T,3C)
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in (q, k, v))  # (B,H,T,hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        h = F.gelu(F.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], eps)
    return x @ P["wte.weight"].t()  # tied LM head, (B,T,V)


def gpt_goldens(seed):
    cfg = GPT_CFG
    V, C, H, T, B, L = (cfg[k] for k in "V C H T B L".split())
    rng = np.random.default_rng([seed, zlib.crc32(b"gpt")])
    params = {}

    def normal(name, shape, std, mean=0.0):
        params[name] = torch.tensor(rng.normal(mean, std, size=shape).astype(np.float32), requires_grad=True)

    normal("wte.weight", (V, C), 0.3)
    normal("wpe.weight", (T, C), 0.1)
    for i in range(L):
        p = "h.%d." % i
        normal(p + "ln_1.weight", (C,), 0.1, 1.0)
        normal(p + "ln_1.bias", (C,), 0.1)
        normal(p + "attn.c_attn.weight", (3 * C, C), 1 / math.sqrt(C))
        normal(p + "attn.c_attn.bias", (3 * C,), 0.1)
        normal(p + "attn.c_proj.weight", (C, C), 1 / math.sqrt(C))
        normal(p + "attn.c_proj.bias", (C,), 0.1)
        normal(p + "ln_2.weight", (C,), 0.1, 1.0)
        normal(p + "ln_2.bias", (C,), 0.1)
        normal(p + "mlp.c_fc.weight", (4 * C, C), 1 / math.sqrt(C))
        normal(p + "mlp.c_fc.bias", (4 * C,), 0.1)
        normal(p + "mlp.c_proj.weight", (C, 4 * C), 1 / math.sqrt(4 * C))
        normal(p + "mlp.c_proj.bias", (C,), 0.1)
    normal("ln_f.weight", (C,), 0.1, 1.0)
    normal("ln_f.bias", (C,), 0.1)

    idx = rng.integers(0, V, size=(B, T), dtype=np.int64)
    targets = rng.integers(0, V, size=(B, T), dtype=np.int64)
    targets[0, 3] = cfg["ignore_index"]
    targets[1, T - 1] = cfg["ignore_index"]

    logits = reference_gpt_logits(params, torch.tensor(idx), L, H, cfg["eps"])
    loss = F.cross_entropy(logits.view(-1, V), torch.tensor(targets).view(-1), ignore_index=cfg["ignore_index"])
    loss.backward()

    recs = [("config", np.array([cfg[k] for k in "V C H T B L".split()], dtype=np.int64)),
            ("eps", np.array([cfg["eps"]], dtype=np.float64)),
            ("ignore_index", np.array([cfg["ignore_index"]], dtype=np.int64)),
            ("idx", idx), ("targets", targets),
            ("logits", logits.detach().numpy()), ("loss", loss.detach().numpy().reshape(()))]
    for name, t in params.items():
        recs.append(("param/" + name, t.detach().numpy()))
    for name, t in params.items():
        recs.append(("grad/" + name, t.grad.numpy()))
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", default=str(DEFAULT_SEED), help="integer seed, or 'time' for a fresh one (printed)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--clean", action="store_true", help="first delete the *.tgg files already in --out")
    ap.add_argument("--ops", default="", help="comma-separated subset of ops (default: all, plus gpt)")
    a = ap.parse_args()
    seed = time.time_ns() % (2**32) if a.seed == "time" else int(a.seed)
    print("make_goldens: seed %d" % seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    if a.clean:
        for f in os.listdir(a.out):
            if f.endswith(".tgg"):
                os.remove(os.path.join(a.out, f))
    wanted = [s for s in a.ops.split(",") if s] or [o for o in OPS if o not in PENDING] + ["gpt"]
    total = 0
    for name in wanted:
        if name == "gpt":
            recs = gpt_goldens(seed)
        else:
            if name not in OPS:
                sys.exit("make_goldens: unknown op '%s' (have: %s)" % (name, ", ".join(OPS)))
            g = OpGoldens(name, seed)
            OPS[name](g)
            recs = g.records
        path = os.path.join(a.out, name + ".tgg")
        write_golden(path, recs)
        total += os.path.getsize(path)
    with open(os.path.join(a.out, "parity_seed.txt"), "w") as f:
        f.write("%d\n" % seed)
    print("make_goldens: wrote %d files, %d bytes, to %s" % (len(wanted), total, a.out))


if __name__ == "__main__":
    main()

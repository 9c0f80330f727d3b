#!/usr/bin/python3
"""Optimizer goldens from PyTorch (fp32, CPU): torch.optim.SGD, Adam and AdamW over 10 steps.

    /usr/bin/python3 tests/reference/make_optim_goldens.py --out tests/reference/goldens        # fixed seed
    /usr/bin/python3 tests/reference/make_optim_goldens.py --seed time --out build/cpu/fresh    # fresh seed

Writes optim_sgd.bin, optim_adam.bin and optim_adamw.bin in the TGGOLD01 format of FORMAT.md (named f32 /
i64 / f64 arrays; the .bin extension keeps them out of test_parity's one-file-per-op check). Read by
tests/optim/test_optim_torch.cpp. Each file holds cases; the records of case C are

    C/args              f64   the optimizer's hyperparameters (order below, per optimizer)
    C/lrs               f64   [STEPS] the lr set before each step (param_groups[0]["lr"])
    C/has_grad          i64   [STEPS, K] 1 when parameter k has a gradient at step s, else its grad is None
    C/init/<k>          f32   parameter k before the first step
    C/grad/<s>/<k>      f32   the gradient of parameter k at step s (absent when has_grad is 0)
    C/after/<s>/<k>     f32   parameter k after step s (s = 0 .. STEPS-1)

args: sgd = [momentum, dampening, nesterov (0/1), weight_decay]; adam, adamw = [beta1, beta2, eps, weight_decay].
Gradients are drawn with numpy from a generator keyed by (seed, file, case), independent of the update.
"""
import argparse
import os
import struct
import time
import zlib

import numpy as np
import torch

MAGIC = b"TGGOLD01"
CODES = {np.dtype(np.float32): 1, np.dtype(np.int64): 2, np.dtype(np.float64): 3}
DEFAULT_SEED = 20240612
STEPS = 10
SHAPES = [(7, 5), (5,), (3, 1, 4)]  # a matrix, a bias-like vector, a 3-D tensor with a size-1 dim
SKIP = {(4, 1), (7, 2)}  # (step, param): no gradient there (PyTorch skips the parameter)


def write_golden(path, records):
    out = bytearray(MAGIC) + struct.pack("<I", len(records))
    for name, arr in records:
        arr = np.array(arr, order="C", copy=True)
        nb = name.encode("utf-8")
        out += struct.pack("<I", len(nb)) + nb + struct.pack("<BI", CODES[arr.dtype], arr.ndim)
        out += struct.pack("<%dq" % arr.ndim, *arr.shape)
        out += arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    with open(path, "wb") as f:
        f.write(out)


def make(opt_name, case, args, make_opt, seed):
    rng = np.random.default_rng([seed, zlib.crc32(opt_name.encode()), zlib.crc32(case.encode())])
    init = [rng.normal(0.0, 1.0, s).astype(np.float32) for s in SHAPES]
    params = [torch.tensor(x, requires_grad=True) for x in init]
    opt = make_opt(params)
    base_lr = opt.param_groups[0]["lr"]
    lrs = np.array([base_lr * (1.0 - 0.05 * s) for s in range(STEPS)], dtype=np.float64)
    has = np.ones((STEPS, len(SHAPES)), dtype=np.int64)
    recs = [(f"{case}/args", np.array(args, dtype=np.float64)), (f"{case}/lrs", lrs)]
    recs += [(f"{case}/init/{k}", x) for k, x in enumerate(init)]
    for s in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = float(lrs[s])
        for k, p in enumerate(params):
            if (s, k) in SKIP:
                has[s, k] = 0
                p.grad = None
                continue
            scale = [1.0, 0.1, 3.0][k]
            g = (rng.normal(0.0, scale, SHAPES[k])).astype(np.float32)
            p.grad = torch.tensor(g)
            recs.append((f"{case}/grad/{s}/{k}", g))
        opt.step()
        recs += [(f"{case}/after/{s}/{k}", p.detach().numpy().copy()) for k, p in enumerate(params)]
    recs.append((f"{case}/has_grad", has))
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the optim_*.bin files")
    ap.add_argument("--seed", default=str(DEFAULT_SEED), help="an integer, or 'time' for a fresh one (printed)")
    a = ap.parse_args()
    seed = int(time.time_ns() % (2**31)) if a.seed == "time" else int(a.seed)
    print(f"make_optim_goldens: seed {seed}")
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    S, A, W = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
    files = {
        "sgd": [
            ("nesterov_wd", [0.9, 0.0, 1, 1e-2], lambda p: S(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)),
            ("momentum_dampening", [0.8, 0.3, 0, 0.0], lambda p: S(p, lr=0.05, momentum=0.8, dampening=0.3)),
            ("plain_wd", [0.0, 0.0, 0, 5e-2], lambda p: S(p, lr=0.2, weight_decay=5e-2)),
        ],
        "adam": [
            ("wd", [0.9, 0.999, 1e-8, 0.1], lambda p: A(p, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
            ("betas", [0.8, 0.95, 1e-6, 0.0], lambda p: A(p, lr=3e-2, betas=(0.8, 0.95), eps=1e-6)),
        ],
        "adamw": [
            ("wd", [0.9, 0.999, 1e-8, 0.1], lambda p: W(p, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
            ("gpt", [0.9, 0.95, 1e-8, 0.1], lambda p: W(p, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)),
        ],
    }
    for name, cases in files.items():
        recs = []
        for case, args, mk in cases:
            recs += make(name, case, args, mk, seed)
        path = os.path.join(a.out, f"optim_{name}.bin")
        write_golden(path, recs)
        print(f"  {path}: {len(recs)} records")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Times one GPT-2 training step (forward, backward, AdamW) in PyTorch and in typegrad, in the same run.

PyTorch is tuned as ../shared/PEERS.md describes (the strongest honest PyTorch on these machines):
torch.set_num_threads(2), OpenBLAS's own CPU detection (OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset),
OPENBLAS_THREAD_TIMEOUT=4, and glibc malloc told to keep memory. Each side runs in its own process.

    /usr/bin/python3 benchmarks/compare_pytorch.py --bench build/release/benchmarks/bench_train_step
    /usr/bin/python3 benchmarks/compare_pytorch.py --bench build/cpu/benchmarks/bench_train_step --precision fp32,bf16
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TUNED_ENV = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}


def torch_step(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    L, H, C, V, Tmax = 12, 12, 768, 50304, 1024

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
            x = x + self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(Tmax, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.t()

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, V, (args.batch, args.seq))
    tgt = torch.randint(0, V, (args.batch, args.seq))
    times = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if args.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, V), tgt.view(-1))
        else:
            loss = F.cross_entropy(model(idx).view(-1, V), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"system": "pytorch " + torch.__version__, "precision": args.precision,
                      "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", help="path to typegrad's bench_train_step (omit to time PyTorch only)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fp32",
                   help="fp32, bf16, or a comma-separated list (fp32,bf16): each precision is timed in PyTorch "
                        "(bf16: torch.autocast('cpu', dtype=torch.bfloat16)) and in typegrad (bf16: bf16_mixed)")
    p.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    for x in precisions:
        if x not in ("fp32", "bf16"):
            p.error(f"--precision: unknown precision '{x}' (expected fp32 or bf16)")
    if args.torch_only:
        torch_step(args)
        return
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env.update(TUNED_ENV)
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    rows = []
    for prec in precisions:  # interleaved: PyTorch then typegrad for each precision
        out = subprocess.run(["/usr/bin/python3", __file__, "--torch-only", "--threads", str(args.threads),
                              "--precision", prec] + common, env=env, check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if args.bench:
            out = subprocess.run([args.bench, "--model", "gpt2", "--threads", str(args.threads), "--precision", prec] + common,
                                 check=True, capture_output=True, text=True)
            rows.append(json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1]))
    load = os.getloadavg()
    print(f"GPT-2 124M training step, B={args.batch} T={args.seq}, {args.threads} threads, median of {args.steps} "
          f"after {args.warmup} warm-up; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| system | precision | median ms/step | min | max | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['system']} | {r['precision']} | {r['median_ms']:.0f} | {r['min_ms']:.0f} | {r['max_ms']:.0f} | "
              f"{args.batch * args.seq / (r['median_ms'] / 1e3):.0f} |")
    by = {(r["system"].split()[0], r["precision"]): r["median_ms"] for r in rows}
    for prec in precisions:
        if ("typegrad", prec) in by and ("pytorch", prec) in by:
            print(f"{prec}: typegrad / pytorch time ratio {by[('typegrad', prec)] / by[('pytorch', prec)]:.2f} "
                  f"(below 1 means typegrad is faster)")
    if ("typegrad", "fp32") in by and ("typegrad", "bf16") in by:
        print(f"typegrad bf16 / typegrad fp32 time ratio {by[('typegrad', 'bf16')] / by[('typegrad', 'fp32')]:.2f}")


if __name__ == "__main__":
    sys.exit(main())

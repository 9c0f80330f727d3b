#!/usr/bin/python3
"""Compares typegrad's CPU GEMM (bench_gemm) with torch.matmul at the GPT-2-small shapes.

Usage (the OPENBLAS variables must not be set for torch's BLAS to pick its own kernels):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 benchmarks/compare_pytorch_gemm.py \
        build/cpu/benchmarks/bench_gemm [--threads 2] [--rounds 3] [--repetitions 1] [--markdown]

Per shape it runs `rounds` rounds of one bench_gemm process (JSON, median of repetitions) followed by
torch.matmul on the same products, then prints: shape, product, precision, ours GFLOP/s, % of the measured
peak (fp32: FMA; bf16: vdpbf16ps where the CPU has it, else the fp32 peak), torch GFLOP/s, the ratio of the
two medians, and the range of the per-round ratios.
Products of a linear layer Y[M,N] = X[M,K] W[N,K]^T:  fwd = X @ W.T,  dX = dY @ W,  dW = dY.T @ X.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

SHAPES = [("qkv", 256, 2304, 768), ("attn_proj", 256, 768, 768), ("fc", 256, 3072, 768),
          ("fc_proj", 256, 768, 3072), ("lm_head", 256, 50304, 768), ("square1024", 1024, 1024, 1024)]
PRODUCTS = ["fwd", "dX", "dW"]


def run_ours(binary, repetitions, threads, bench_filter="^gemm/ours/|^gemm/eigen/|^peak/"):
    cmd = [binary, "--benchmark_format=json", f"--benchmark_filter={bench_filter}",
           f"--benchmark_repetitions={repetitions}", "--benchmark_report_aggregates_only=true",
           "--benchmark_min_time=0.3"]
    env = dict(__import__("os").environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    data = json.loads(out)
    res = {}
    for b in data["benchmarks"]:
        # With repetitions, the median aggregate; a single repetition reports no aggregates, only the run.
        if b.get("aggregate_name", "median" if repetitions == 1 else None) != "median":
            continue
        name = b["run_name"]  # gemm/ours/fp32/qkv/fwd/real_time
        parts = name.split("/")
        if parts[0] == "gemm" and len(parts) >= 5:
            prec = parts[2] if parts[1] == "ours" else "eigen-" + parts[2]
            res[(parts[3], parts[4], prec)] = (b["GFLOPS"], b.get("pct_fp32_peak"), b.get("pct_bf16_peak"))
        elif parts[0] == "peak":
            res[("peak", parts[1], parts[2])] = (b["GFLOPS"], None, None)
    return data.get("context", {}), res


def time_torch(torch, M, N, K, product, dtype, min_time=0.3, min_reps=5):
    """GFLOP/s of torch.matmul for one product: flops over the mean time of the calls in the window, the same
    statistic bench_gemm reports per run (Google Benchmark's time per iteration). The median call, used until
    2026-12-04, left out torch's slow calls while ours were counted."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(M, K, generator=g).to(dtype)
    W = torch.randn(N, K, generator=g).to(dtype)
    dY = torch.randn(M, N, generator=g).to(dtype)
    f = {"fwd": lambda: torch.matmul(X, W.t()),
         "dX": lambda: torch.matmul(dY, W),
         "dW": lambda: torch.matmul(dY.t(), X)}[product]
    t0 = time.perf_counter()
    f()  # warm-up; calls over a second (netlib BLAS at lm_head size) get just 3 timed repeats
    if time.perf_counter() - t0 > 1.0:
        min_reps = 3
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 2.0 * M * N * K / statistics.mean(times) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_gemm", help="path to the bench_gemm binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=1, help="bench_gemm repetitions per round (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per shape, each one bench_gemm process then torch; the table shows medians")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)

    # The machines are shared and their speed drifts by several percent within minutes. Each shape runs in
    # rounds: one bench_gemm process (its % of peak uses the peaks measured at that process's start), then
    # torch on the same products, so both sides of a round are close in time; the table shows each side's
    # median over the rounds and the range of the per-round ratios.
    context, ours = run_ours(args.bench_gemm, 1, args.threads, "^peak/")
    per_shape_peaks = []
    torch_gflops = {}
    round_ratios = {}
    for name, M, N, K in SHAPES:
        ours_rounds, torch_rounds = {}, {}
        for _ in range(max(1, args.rounds)):
            ctx, res = run_ours(args.bench_gemm, args.repetitions, args.threads, f"^gemm/(ours|eigen)/[^/]+/{name}/(fwd|dX|dW)/")
            for key, value in res.items():
                ours_rounds.setdefault(key, []).append(value)
            per_shape_peaks.append((name, ctx.get(f"peak_fp32_GFLOPS_{args.threads}threads"),
                                    ctx.get(f"peak_bf16_GFLOPS_{args.threads}threads")))
            for product in PRODUCTS:
                for prec, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                    gf = time_torch(torch, M, N, K, product, dtype)
                    torch_rounds.setdefault((name, product, prec), []).append(gf)
                    if (name, product, prec) in res:
                        round_ratios.setdefault((name, product, prec), []).append(res[(name, product, prec)][0] / gf)
        for key, values in ours_rounds.items():
            ours[key] = tuple(None if values[0][i] is None else statistics.median(v[i] for v in values)
                              for i in range(3))
        for key, values in torch_rounds.items():
            torch_gflops[key] = statistics.median(values)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"ours: fp32 = {context.get('gemm_kernel_fp32')}, bf16 = {context.get('gemm_kernel_bf16')}")
    for k, v in sorted(context.items()):
        if k.startswith("peak_") or k == "cpu_features":
            print(f"# {k}: {v}")
    for (a, b, c), (gf, _, _) in sorted(ours.items()):
        if a == "peak":
            print(f"# measured peak {b} {c}: {gf:.1f} GFLOP/s")
    for name, p32, p16 in per_shape_peaks:
        print(f"# peaks measured before {name}: fp32 {p32}; bf16 {p16}")
    print(f"# {max(1, args.rounds)} rounds per shape; GFLOP/s and % peak are medians over the rounds")

    rows = []
    for name, M, N, K in SHAPES:
        for product in PRODUCTS:
            for prec, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                o = ours.get((name, product, prec))
                t = torch_gflops[(name, product, prec)]
                if o is None:
                    continue
                pct = o[1] if prec == "fp32" else o[2]
                eig = ours.get((name, product, "eigen-" + prec), (float("nan"),))[0]
                rr = round_ratios.get((name, product, prec), [o[0] / t])
                rows.append((f"{name} ({M},{N},{K})", product, prec, o[0], pct, t, o[0] / t, eig,
                             f"{min(rr):.2f}-{max(rr):.2f}"))
    hdr = ("shape (M,N,K)", "product", "prec", "ours GFLOP/s", "% peak", "torch GFLOP/s", "ours/torch",
           "Eigen GFLOP/s", "ours/torch per round")
    if args.markdown:
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in rows:
            eig = "" if r[7] != r[7] else f"{r[7]:.1f}"
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.0f}% | {r[5]:.1f} | {r[6]:.2f} | {eig} | {r[8]} |")
    else:
        print(f"{hdr[0]:<28}{hdr[1]:<8}{hdr[2]:<6}{hdr[3]:>14}{hdr[4]:>8}{hdr[5]:>15}{hdr[6]:>12}{hdr[7]:>15}"
              f"{hdr[8]:>22}")
        for r in rows:
            print(f"{r[0]:<28}{r[1]:<8}{r[2]:<6}{r[3]:>14.1f}{r[4]:>7.0f}%{r[5]:>15.1f}{r[6]:>12.2f}{r[7]:>15.1f}"
                  f"{r[8]:>22}")
    for prec in ("fp32", "bf16"):
        sel = [r for r in rows if r[2] == prec]
        if sel:
            print(f"# {prec}: median {statistics.median(r[4] for r in sel):.0f}% of the {prec} peak, "
                  f"min {min(r[4] for r in sel):.0f}%; ours/torch median {statistics.median(r[6] for r in sel):.2f}, "
                  f"min {min(r[6] for r in sel):.2f}; ours faster than torch at {sum(r[6] > 1 for r in sel)}/{len(sel)} products")
    return 0


if __name__ == "__main__":
    sys.exit(main())

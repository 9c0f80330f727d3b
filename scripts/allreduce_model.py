#!/usr/bin/env python3
"""Models, on paper, the gradient all-reduce of one data-parallel training step for GPT-2 124M and GPT-2 1.5B on
8 GPUs (one node, NVLink) and 64 GPUs (8 nodes of 8, InfiniBand), next to a measured compute time per step.

  /usr/bin/python3 scripts/allreduce_model.py
  /usr/bin/python3 scripts/allreduce_model.py --compute-ms-124m 72.5 --compute-ms-1558m 950

Ring model (bandwidth-optimal ring: reduce-scatter then all-gather, 2(N-1) steps each moving B/N bytes):
  t(B, N) = 2(N-1)/N * B / busbw + 2(N-1) * latency
with B = parameters * bytes per element (fp32: 4, bf16: 2). MB and GB are decimal (1e6, 1e9 bytes).

Parameters from the GPT-2 formula (vocabulary V = 50257, context 1024, tied LM head):
  V*C + 1024*C  +  L * (12*C^2 + 13*C)  +  2*C
  per block: qkv 3C^2+3C, proj C^2+C, fc 4C^2+4C, fc_proj 4C^2+C, two LayerNorms 4C; final LayerNorm 2C.
  GPT-2 124M (L=12, C=768) = 124,439,808; GPT-2 1.5B (XL: L=48, C=1600, 25 heads) = 1,557,611,200.

Links (assumed figures, not measured here):
  8 GPUs:  NVLink 4 on H100/H200 SXM, 900 GB/s total bidirectional per GPU = 450 GB/s per direction (NVIDIA
           H100/H200 SXM datasheets); NCCL all_reduce_perf busbw on 8xH100 is about 360-480 GB/s, so assumed
           360 GB/s busbw and 5 us latency per ring step.
  64 GPUs: InfiniBand NDR, 400 Gb/s per GPU (one ConnectX-7 per GPU, as in DGX H100) = 50 GB/s per direction;
           assumed 40 GB/s busbw and 10 us latency per ring step. The inter-node links are the bottleneck, so the
           64 GPUs are modelled as one flat ring over N = 64 ranks at the IB figures: an upper bound. NCCL's
           tree and hierarchical algorithms do better, mostly in the latency term.

Hiding behind backward: backward is 2/3 of the compute time (forward : backward = 1 : 2). Gradients are reduced
in buckets of S bytes, bucket k as soon as backward has produced it; the last bucket can only start when
backward ends. Each bucket is one ring all-reduce, so the n = ceil(B/S) buckets together take n * t(S, N)
(the bandwidth term of t(B, N) plus n latency terms), and
  exposed = max(0, n * t(S, N) - backward) + t(S, N).
The bucket size that hides the reduction is the smallest listed one whose exposed time is under 5% of the
compute time; "cannot hide" when even one unbucketed all-reduce t(B, N) exceeds backward.

The 1.5B compute time, unless given, is the 124M figure scaled by the parameter ratio (FLOPs per token ~ 6N at
equal tokens, the attention term ignored): scaled from 124M, not measured.
"""
import argparse
import math

VOCAB = 50257
CONTEXT = 1024
MB = 1e6
GB = 1e9
US = 1e-6

# (name, layers L, width C, expected parameter count)
MODELS = [
    ("GPT-2 124M", 12, 768, 124_439_808),
    ("GPT-2 1.5B", 48, 1600, 1_557_611_200),
]

# (GPUs N, link, busbw bytes/s per direction, latency s per ring step)
LINKS = [
    (8, "NVLink 4", 360 * GB, 5 * US),
    (64, "IB NDR", 40 * GB, 10 * US),
]

WIRE = [("fp32", 4), ("bf16", 2)]
BUCKETS_MB = [1, 5, 25, 100]
BACKWARD_FRACTION = 2.0 / 3.0
DEFAULT_COMPUTE_MS_124M = 123.4  # docs/performance.md, "GPU training step (CUDA)", commit 6dd2b98
HIDDEN_IF_UNDER = 0.05  # exposed time as a fraction of the compute time


def gpt2_params(layers, width, vocab=VOCAB, context=CONTEXT):
    c = width
    embeddings = vocab * c + context * c  # wte (tied with the LM head) + wpe
    block = 12 * c * c + 13 * c  # qkv 3C^2+3C, proj C^2+C, fc 4C^2+4C, fc_proj 4C^2+C, 2 LayerNorms 4C
    return embeddings + layers * block + 2 * c  # + final LayerNorm


def ring_allreduce_s(nbytes, ranks, busbw, latency):
    # 2(N-1) steps (N-1 reduce-scatter, N-1 all-gather), each moving nbytes/N per rank
    return 2 * (ranks - 1) / ranks * nbytes / busbw + 2 * (ranks - 1) * latency


def exposed_s(nbytes, bucket, ranks, busbw, latency, backward):
    # n buckets, one ring all-reduce each; the last starts when backward ends
    bucket = min(bucket, nbytes)
    n = math.ceil(nbytes / bucket)
    t_bucket = ring_allreduce_s(bucket, ranks, busbw, latency)
    return max(0.0, n * t_bucket - backward) + t_bucket


def main():
    doc = __doc__.splitlines()
    ap = argparse.ArgumentParser(description=" ".join(doc[0:2]), epilog="\n".join(doc[6:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute-ms-124m", type=float, default=DEFAULT_COMPUTE_MS_124M,
                    help="compute ms/step for GPT-2 124M (default 123.4: typegrad, bf16, B=16, T=1024, one H200, "
                         "docs/performance.md)")
    ap.add_argument("--compute-ms-1558m", type=float, default=None,
                    help="compute ms/step for GPT-2 1.5B (default: the 124M figure times the parameter ratio)")
    ap.add_argument("--tokens-per-gpu", type=int, default=16 * 1024, help="tokens per GPU per step (default 16*1024)")
    a = ap.parse_args()
    if a.compute_ms_124m <= 0 or (a.compute_ms_1558m is not None and a.compute_ms_1558m <= 0):
        ap.error("compute times must be positive")
    if a.tokens_per_gpu <= 0:
        ap.error("--tokens-per-gpu must be positive")

    params = {}
    for name, layers, width, expected in MODELS:
        params[name] = gpt2_params(layers, width)
        assert params[name] == expected, (name, params[name], expected)

    small, large = MODELS[0][0], MODELS[1][0]
    ratio = params[large] / params[small]
    compute_ms = {small: a.compute_ms_124m}
    if a.compute_ms_124m == DEFAULT_COMPUTE_MS_124M:
        small_note = f"{compute_ms[small]:g} ms (typegrad, bf16, B=16, T=1024, one H200, docs/performance.md)"
    else:
        small_note = f"{compute_ms[small]:g} ms (given)"
    if a.compute_ms_1558m is None:
        compute_ms[large] = a.compute_ms_124m * ratio
        large_note = f"{compute_ms[large]:.1f} ms = {a.compute_ms_124m:g} ms x {ratio:.3f} (parameter ratio): " \
                     "scaled from 124M, not measured"
    else:
        compute_ms[large] = a.compute_ms_1558m
        large_note = f"{compute_ms[large]:g} ms (given)"

    print("Data-parallel gradient all-reduce per step, ring model (on paper, not measured)")
    print("  t(B, N) = 2(N-1)/N * B / busbw + 2(N-1) * latency; B = parameters * bytes/element (fp32 4, bf16 2); "
          "MB = 1e6 bytes")
    print("  8 GPUs:  NVLink 4 (H100/H200 SXM datasheets: 900 GB/s bidirectional per GPU = 450 GB/s per direction; "
          "NCCL busbw on 8xH100 ~360-480 GB/s):")
    print("           assumed 360 GB/s busbw, 5 us latency per ring step")
    print("  64 GPUs: 8 nodes x 8, InfiniBand NDR 400 Gb/s per GPU (ConnectX-7, as in DGX H100) = 50 GB/s per "
          "direction: assumed 40 GB/s busbw,")
    print("           10 us latency per ring step; flat ring over N=64 at the IB figures = upper bound "
          "(NCCL tree/hierarchical do better on latency)")
    print("  hiding:  backward = 2/3 of compute; buckets of S: exposed = max(0, ceil(B/S)*t(S) - backward) + t(S); "
          f"hidden if exposed < {HIDDEN_IF_UNDER:.0%} of compute")
    print(f"  compute per step: {small} {small_note}")
    print(f"                    {large} {large_note}")
    print(f"  tokens/s per GPU at {a.tokens_per_gpu} tokens/GPU/step: compute only / with the exposed comm "
          "of the best listed bucket")
    print()

    bucket_hdr = " ".join(f"{f'exp{s}MB':>8}" for s in BUCKETS_MB)
    header = (f"{'model':<10} {'GPUs':>4} {'link':<8} {'wire':<4} {'params':>13} {'grad MB':>8} {'AR ms':>7} "
              f"{'lat ms':>6} {'step ms':>8} {'bwd ms':>7} | {bucket_hdr} | {'hides at':<11} | "
              f"{'tok/s/GPU':>9} {'w/ comm':>8}")
    print(header)
    print("-" * len(header))
    for name, _, _, _ in MODELS:
        p = params[name]
        step = compute_ms[name] / 1e3
        backward = BACKWARD_FRACTION * step
        for ranks, link, busbw, latency in LINKS:
            for wire, elem in WIRE:
                nbytes = p * elem
                t_all = ring_allreduce_s(nbytes, ranks, busbw, latency)
                exposed = [exposed_s(nbytes, s * MB, ranks, busbw, latency, backward) for s in BUCKETS_MB]
                if t_all > backward:
                    hides = "cannot hide"
                else:
                    hiding = [s for s, e in zip(BUCKETS_MB, exposed) if e < HIDDEN_IF_UNDER * step]
                    hides = f"{hiding[0]} MB" if hiding else "none < 5%"
                tps = a.tokens_per_gpu / step
                tps_comm = a.tokens_per_gpu / (step + min(exposed))
                t_lat = ring_allreduce_s(0, ranks, busbw, latency)
                exp_cols = " ".join(f"{e * 1e3:8.2f}" for e in exposed)
                print(f"{name:<10} {ranks:>4} {link:<8} {wire:<4} {p:>13,} {nbytes / MB:8.1f} {t_all * 1e3:7.2f} "
                      f"{t_lat * 1e3:6.2f} {step * 1e3:8.1f} {backward * 1e3:7.1f} | {exp_cols} | {hides:<11} | "
                      f"{tps:9,.0f} {tps_comm:8,.0f}")
        print()

    print("AR ms: one unbucketed all-reduce of all gradients, of which lat ms is the latency term 2(N-1) * latency.")
    print("expSMB: exposed ms (communication left on the step's critical path) with buckets of S MB; each bucket pays its own "
          "latency term.")
    print("hides at: the smallest listed bucket size whose exposed time is under 5% of the compute time.")


if __name__ == "__main__":
    main()

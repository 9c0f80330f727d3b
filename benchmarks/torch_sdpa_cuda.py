"""PyTorch's fused causal attention on the GPU, forward + backward: the peer of bench_cuda_attention.

torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) on (B, H, T, D) tensors (PyTorch picks
its flash kernel for bf16/fp16), timed as bench_cuda_attention times typegrad's: reps per round, the median of
the rounds. Prints one RESULT line for scripts/gpu-check.sh.
    python3 benchmarks/torch_sdpa_cuda.py --precision bf16 --batch 16 --heads 12 --seq 1024 --head-size 64
"""
import argparse
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dt = torch.bfloat16 if a.precision == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (a.batch, a.heads, a.seq, a.head_size)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
    u = torch.randn(shape, device="cuda", dtype=dt, generator=g)

    def once():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(u)
        q.grad = k.grad = v.grad = None

    times = []
    for _ in range(a.rounds):
        once()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            once()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0) / a.reps)
    times.sort()
    ms = times[len(times) // 2]
    print(f"device     {torch.cuda.get_device_name()}")
    print(f"shape      {a.precision} B={a.batch} H={a.heads} T={a.seq} D={a.head_size}, causal, forward + backward")
    print(f"torch sdpa {ms:.3f} ms (torch {torch.__version__})")
    print(f"RESULT torch_ms={ms:.3f}")


if __name__ == "__main__":
    main()

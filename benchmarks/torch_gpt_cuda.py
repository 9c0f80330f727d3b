#!/usr/bin/env python3
"""PyTorch's equivalent of bench_cuda_gpt: the same GPT-2 architecture (pre-LN blocks, tied LM head,
GELU-tanh MLP, causal attention through F.scaled_dot_product_attention), fp32 master weights with
autocast to --precision, fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), synthetic tokens. GPT-2's
embedding and tied LM head are stored padded to a multiple of --vocab-multiple rows (128, as nanoGPT pads to 50304
and as bench_cuda_gpt stores them), the loss reading the 50257 real tokens' logits: both sides run the same aligned
LM-head GEMMs.
Prints the same table and RESULT line as bench_cuda_gpt, so scripts/gpu-check.sh can compare them.

    python3 benchmarks/torch_gpt_cuda.py --model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10
"""
import argparse
import math
import sys
import time

MODELS = {"tiny": (256, 256, 4, 4, 128), "small": (50257, 1024, 6, 6, 384), "gpt2": (50257, 1024, 12, 12, 768)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches of B x T per optimizer step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--vocab-multiple", type=int, default=128,
                    help="the embedding's rows padded to a multiple of this (not the tiny model's; 1: unpadded)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (slower start)")
    ap.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune"],
                    help="torch.compile's mode when --compile is given")
    a = ap.parse_args()
    if a.grad_accum < 1:
        ap.error(f"--grad-accum needs a whole number of at least 1, got {a.grad_accum}")
    if a.vocab_multiple < 1:
        ap.error(f"--vocab-multiple needs a whole number of at least 1, got {a.vocab_multiple}")

    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError as e:
        sys.exit(f"torch_gpt_cuda: PyTorch is not importable: {e}")
    if not torch.cuda.is_available():
        sys.exit("torch_gpt_cuda: torch.cuda.is_available() is False")

    V, block, L, H, C = MODELS[a.model]
    multiple = 1 if a.model == "tiny" else a.vocab_multiple
    V_rows = (V + multiple - 1) // multiple * multiple  # the embedding's rows; tokens and the loss use the first V
    dev = "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.precision]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V_rows, C), nn.Embedding(block, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for b in self.h:
                x = b(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V_rows)
            if V_rows != V:
                logits = logits[..., :V]  # the real tokens (.float() below makes it contiguous)
            return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))  # targets: a strided slice

    torch.manual_seed(1)
    model = GPT().to(dev)
    # GPT-2's initialisation (as nn::BasicGPT): N(0, 0.02) weights, N(0, 0.02/sqrt(2L)) for the residual
    # projections, zero biases. PyTorch's default N(0, 1) embeddings through the tied head would start the
    # loss near 200 instead of ln V.
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * L) if name.endswith(("attn_proj", "mlp_proj")) else 0.02
            nn.init.normal_(m.weight, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    n_params = sum(p.numel() for p in model.parameters()) - (V_rows - V) * C  # the padding rows are not counted
    step_model = torch.compile(model, mode=a.compile_mode) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator(device="cpu").manual_seed(7)

    def step():  # one optimizer step over a.grad_accum micro-batches; returns the last one's loss
        for _ in range(a.grad_accum):
            idx = torch.randint(0, V, (a.batch, a.seq + 1), generator=g).to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=dtype, enabled=a.precision != "fp32"):
                loss = step_model(idx[:, :-1], idx[:, 1:])
            (loss / a.grad_accum if a.grad_accum > 1 else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = 0.0
    for _ in range(a.warmup):
        first = step().item()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    last = loss.item()
    tokens = a.batch * a.seq * a.grad_accum * a.steps
    tps = tokens / secs
    mfu = tps * (6 * n_params + 12 * L * a.seq * C) / (a.peak_tflops * 1e12)
    print(f"device        {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"model         {a.model} ({n_params / 1e6:.1f}M parameters, embedding stored as {V_rows} rows), {a.precision}, "
          f"B={a.batch} T={a.seq}, grad-accum {a.grad_accum}, AdamW (fused), {a.steps} steps after {a.warmup} warm-up")
    print(f"loss          {first:.4f} (warm-up) -> {last:.4f}")
    print(f"ms/step       {1e3 * secs / a.steps:.1f}")
    print(f"tokens/s      {tps:.0f}")
    print(f"MFU           {100 * mfu:.1f}% of {a.peak_tflops:.0f} TFLOP/s")
    print(f"peak memory   {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(f"RESULT tokens_per_s={tps:.0f} ms_per_step={1e3 * secs / a.steps:.2f} mfu={mfu:.4f} peak_gib={peak_gib:.2f} "
          f"loss={last:.4f}")
    return 0 if math.isfinite(last) else 1


if __name__ == "__main__":
    sys.exit(main())

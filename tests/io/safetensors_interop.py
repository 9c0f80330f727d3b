#!/usr/bin/python3
"""PyTorch <-> typegrad safetensors interop, both ways, through the reference GPT of tests/reference.

    /usr/bin/python3 tests/io/safetensors_interop.py --tool build/cpu/tests/io/tg_safetensors_interop --work /tmp/x

1. typegrad writes a random GPT's weights (and the logits it computes for some tokens); this script
   reads the file with its own safetensors reader (Debian has no `safetensors` package), checks the
   CRC32C checksums with its own CRC, loads the weights into make_goldens.reference_gpt_logits and
   compares the logits.
2. This script writes random GPT weights from PyTorch with its own writer, once as F32 and once as BF16,
   typegrad loads them and computes logits, which must match PyTorch's on the same (rounded) weights.
Both run twice: as is, and with typegrad storing the token embedding's 61 rows padded to 64
(TG_INTEROP_VOCAB_MULTIPLE=16, Note [padded vocabulary]): the files hold the real shapes either way.
Exits 77 (CTest's skip code) when torch cannot be imported.
"""
import argparse
import json
import os
import struct
import subprocess
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print("SKIP: safetensors_interop needs numpy and torch (python3-torch): %s" % e)
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from make_goldens import reference_gpt_logits  # noqa: E402

# ---- a small safetensors reader / writer -----------------------------------------------------------
NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def st_read(path):
    """Returns ({name: torch tensor}, metadata, {name: raw bytes}); checks the layout like the C++ reader."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert 8 + n <= len(blob), "%s: header runs past the end" % path
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    out, raw, spans = {}, {}, []
    for name, e in header.items():
        b, end = e["data_offsets"]
        buf = data[b:end]
        spans.append((b, end))
        raw[name] = buf
        if e["dtype"] == "BF16":
            u16 = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32).reshape(e["shape"])
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(NP_DTYPES[e["dtype"]]).newbyteorder("<")).reshape(e["shape"])
        out[name] = torch.from_numpy(arr.copy())
    spans.sort()
    at = 0
    for b, end in spans:
        assert b == at, "%s: hole or overlap at byte %d" % (path, b)
        at = end
    assert at == len(data), "%s: %d bytes not covered" % (path, len(data) - at)
    return out, meta, raw


def st_write(path, tensors, metadata=None, bf16=False):
    """tensors: {name: float32 torch tensor}; bf16 stores them as BF16 (round to nearest even)."""
    header, chunks, at = {}, [], 0
    for name, t in tensors.items():
        a = t.detach().contiguous()
        if bf16:
            buf = a.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
            dtype = "BF16"
        else:
            buf = a.numpy().astype("<f4").tobytes()
            dtype = "F32"
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(buf)]}
        chunks.append(buf)
        at += len(buf)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def crc32c(data):
    table = crc32c.table
    if table is None:
        table = crc32c.table = []
        for b in range(256):
            c = b
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
    c = 0xFFFFFFFF
    for byte in data:
        c = (c >> 8) ^ table[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


crc32c.table = None

# ---- the test --------------------------------------------------------------------------------------
CFG = dict(V=61, C=48, H=4, T=16, L=2)


def cfg_args():
    return [str(CFG[k]) for k in ("V", "C", "H", "T", "L")]


def compare(name, got, want):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    ok = err <= 2e-5 * max(1.0, scale)
    print("  %-44s max |diff| %.3e (logits up to %.2f) %s" % (name, err, scale, "ok" if ok else "FAIL"))
    return ok


def check(a, multiple):
    """Both directions with typegrad's embedding rows stored padded to `multiple` (the files hold V rows either way)."""
    ok = True
    sfx = "_m%d" % multiple
    # 1. typegrad -> PyTorch
    w_tg, io_tg = os.path.join(a.work, "tg_weights%s.safetensors" % sfx), os.path.join(a.work, "tg_io%s.safetensors" % sfx)
    subprocess.run([a.tool, "save"] + cfg_args() + ["1234", w_tg, io_tg], check=True)
    P, meta, raw = st_read(w_tg)
    assert tuple(P["wte.weight"].shape) == (CFG["V"], CFG["C"]), "wte must be stored with the real vocabulary's rows"
    sums = json.loads(meta["tg.crc32c"])
    assert set(sums) == set(P), "checksums do not cover every tensor"
    for name, buf in raw.items():
        assert sums[name] == "%08x" % crc32c(buf), "%s: checksum mismatch (typegrad's CRC32C disagrees)" % name
    print("typegrad -> PyTorch: %d tensors, format '%s', all %d CRC32C checksums verified in Python"
          % (len(P), meta.get("format"), len(sums)))
    io, _, _ = st_read(io_tg)
    want = io["logits"]
    got = reference_gpt_logits(P, io["idx"], CFG["L"], CFG["H"])
    ok &= compare("reference GPT logits vs typegrad's", got, want)

    # 2. PyTorch -> typegrad, F32 and BF16
    g = torch.Generator().manual_seed(99)
    C, V, T, L = CFG["C"], CFG["V"], CFG["T"], CFG["L"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(L):
        p = "h.%d." % i
        shapes.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "attn.c_attn.weight": (3 * C, C),
                       p + "attn.c_attn.bias": (3 * C,), p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                       p + "ln_2.weight": (C,), p + "ln_2.bias": (C,), p + "mlp.c_fc.weight": (4 * C, C),
                       p + "mlp.c_fc.bias": (4 * C,), p + "mlp.c_proj.weight": (C, 4 * C), p + "mlp.c_proj.bias": (C,)})
    W = {}
    for name, shape in shapes.items():
        gain = ".ln_" in "." + name and name.endswith(".weight")
        W[name] = (1.0 if gain else 0.0) + 0.2 * torch.randn(shape, generator=g)
    idx = torch.randint(0, V, (2, T), generator=g)
    io_py = os.path.join(a.work, "py_io%s.safetensors" % sfx)
    st_write(io_py, {})  # placeholder overwritten below (keeps the writer honest about empty files)
    with open(io_py, "rb") as f:
        assert f.read() == struct.pack("<Q", 8) + b"{}      "
    # idx as I64: written by hand (st_write handles floats only)
    buf = idx.numpy().astype("<i8").tobytes()
    h = json.dumps({"idx": {"dtype": "I64", "shape": [2, T], "data_offsets": [0, len(buf)]}}).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(io_py, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + buf)
    for bf16 in (False, True):
        w_py = os.path.join(a.work, "py_weights_%s.safetensors" % ("bf16" if bf16 else "f32"))
        st_write(w_py, W, {"format": "pt"}, bf16=bf16)
        out = os.path.join(a.work, "py_out.safetensors")
        subprocess.run([a.tool, "logits"] + cfg_args() + [w_py, io_py, out], check=True)
        got, _, _ = st_read(out)
        Wr = {k: v.to(torch.bfloat16).to(torch.float32) if bf16 else v for k, v in W.items()}
        want = reference_gpt_logits(Wr, idx, L, CFG["H"])
        ok &= compare("PyTorch %s weights -> typegrad logits" % ("BF16" if bf16 else "F32"), got["logits"], want)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    torch.set_num_threads(1)
    assert crc32c(b"123456789") == 0xE3069283
    ok = True

    for multiple in (1, 16):  # 16: typegrad stores wte's 61 rows padded to 64 (Note [padded vocabulary])
        os.environ["TG_INTEROP_VOCAB_MULTIPLE"] = str(multiple)
        print("vocab_multiple %d:" % multiple)
        ok &= check(a, multiple)
    print("safetensors_interop: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

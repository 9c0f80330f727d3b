#!/usr/bin/env python3
"""Makes hostile variants of typegrad checkpoints for the trainer's reliability tests (tests/trainer/reliability.sh).

  ckpt_tool.py state SRC                          print the "tg.state" JSON of a training checkpoint
  ckpt_tool.py edit-state SRC DST PATH=JSON ...   rewrite fields of "tg.state" (dotted paths, JSON values) with a
                                                  valid CRC32C, so only the trainer's range checks can catch them
  ckpt_tool.py weights-nan SRC DST [VALUE]        the parameters of SRC as a plain weights file ("format": "pt",
                                                  no checksums) whose first parameter's element 1 is VALUE (nan)
  ckpt_tool.py flip-byte SRC                      flip one byte of the tensor data in place (a checksum mismatch)
"""
import json
import struct
import sys


def crc32c(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def read(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(path, header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def main():
    cmd, src = sys.argv[1], sys.argv[2]
    header, data = read(src)
    if cmd == "state":
        print(header["__metadata__"]["tg.state"])
    elif cmd == "edit-state":
        state = json.loads(header["__metadata__"]["tg.state"])
        for edit in sys.argv[4:]:
            path, value = edit.split("=", 1)
            keys = path.split(".")
            node = state
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = json.loads(value)
        text = json.dumps(state, separators=(",", ":"))
        header["__metadata__"]["tg.state"] = text
        header["__metadata__"]["tg.state.crc32c"] = "%08x" % crc32c(text.encode())
        write(sys.argv[3], header, data)
    elif cmd == "weights-nan":
        value = float(sys.argv[4]) if len(sys.argv) > 4 else float("nan")
        names = [k for k in header if k != "__metadata__" and not k.startswith("optim.")]
        out, blob = {"__metadata__": {"format": "pt"}}, b""
        for k in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
            b, e = header[k]["data_offsets"]
            piece = bytearray(data[b:e])
            if k == names[0]:
                piece[4:8] = struct.pack("<f", value)
            out[k] = {"dtype": header[k]["dtype"], "shape": header[k]["shape"], "data_offsets": [len(blob), len(blob) + len(piece)]}
            blob += bytes(piece)
        write(sys.argv[3], out, blob)
        print(names[0])
    elif cmd == "flip-byte":
        raw = bytearray(open(src, "rb").read())
        raw[-5] ^= 0xFF
        open(src, "wb").write(bytes(raw))
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()

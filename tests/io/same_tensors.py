#!/usr/bin/env python3
"""Exit 0 when two safetensors files hold byte-identical tensor data (everything after the header), 1 otherwise.

The trainer end-to-end tests use it to show that a resumed run wrote the same weights, optimizer state and
masks as the run never stopped:
    /usr/bin/python3 tests/io/same_tensors.py a.safetensors b.safetensors
"""
import struct
import sys


def data(path):
    b = open(path, "rb").read()
    return b[8 + struct.unpack("<Q", b[:8])[0]:]


a, b = data(sys.argv[1]), data(sys.argv[2])
sys.exit(0 if a == b and len(a) > 0 else 1)

#!/usr/bin/env python3
"""Per-kernel summary of an Nsight Compute CSV of kernel durations, for scripts/gpu-check.sh.

Reads the output of
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv PROGRAM ...
(ncu's own "==PROF==" lines before the CSV are skipped), sums each kernel's duration by name (the demangled
name up to its argument list, so every instantiation counts apart; names longer than --width are cut), and
prints the total, then a Markdown table of the --top kernels by time (calls, ms, share of the total) and one
row for the rest. ncu runs each kernel alone with flushed caches, so the total is above a timed step's.

    python3 benchmarks/ncu_summary.py build/gpu/gpu-check-logs/ncu.csv --top 15
"""
import argparse
import csv
import sys

UNIT_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}


def short_name(name: str, width: int) -> str:
    """The kernel's name up to its top-level argument list, without a leading 'void ', cut to width."""
    name = name.strip().replace("(anonymous namespace)", "{anon}")  # part of the name, not an argument list
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0:
            name = name[:i]
            break
    return name if len(name) <= width else name[: width - 1] + "…"


def read_rows(lines):
    """The CSV rows (dicts) after ncu's header line; a missing header is an error naming the first lines."""
    for i, line in enumerate(lines):
        if line.startswith('"ID"'):
            return list(csv.DictReader(lines[i:]))
    head = "".join(lines[:5]).strip() or "(empty)"
    raise SystemExit(f"ncu_summary: no CSV header (a line starting with \"ID\") in the input; it begins:\n{head}")


def summarize(rows, top: int, width: int):
    kernels = {}  # name -> [calls, ms]
    name_key = "Kernel Name" if rows and "Kernel Name" in rows[0] else "Function Name"
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond").strip()
        if unit not in UNIT_MS:
            raise SystemExit(f"ncu_summary: unknown duration unit '{unit}'")
        value = float(r["Metric Value"].replace(",", "")) * UNIT_MS[unit]
        k = kernels.setdefault(short_name(r[name_key], width), [0, 0.0])
        k[0] += 1
        k[1] += value
    if not kernels:
        raise SystemExit("ncu_summary: the CSV holds no gpu__time_duration.sum rows (did ncu profile any kernel?)")
    total = sum(ms for _, ms in kernels.values())
    calls = sum(c for c, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    out = [f"ncu: {calls} kernel launches, {len(kernels)} kernels by name, {total:.2f} ms in all", "",
           "| kernel | calls | ms | share |", "|---|---|---|---|"]
    for name, (c, ms) in ranked[:top]:
        out.append(f"| `{name}` | {c} | {ms:.2f} | {100 * ms / total:.1f}% |")
    rest = ranked[top:]
    if rest:
        c = sum(v[0] for _, v in rest)
        ms = sum(v[1] for _, v in rest)
        out.append(f"| the other {len(rest)} kernels | {c} | {ms:.2f} | {100 * ms / total:.1f}% |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --csv output ('-' for stdin)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by name (the rest in one row)")
    ap.add_argument("--width", type=int, default=90, help="longest kernel name printed")
    a = ap.parse_args()
    if a.top < 1 or a.width < 10:
        ap.error("--top needs at least 1 and --width at least 10")
    lines = (sys.stdin if a.csv == "-" else open(a.csv, encoding="utf-8", errors="replace")).readlines()
    print(summarize(read_rows(lines), a.top, a.width))


if __name__ == "__main__":
    main()

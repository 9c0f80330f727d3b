#!/usr/bin/env python3
"""Draws a train_gpt JSON-lines log (--log) as one figure with matplotlib: train and validation loss against
tokens seen, the learning rate, and tokens/s. The output format follows the file name (.png or .svg).

  /usr/bin/python3 scripts/plot_log.py run.jsonl run.png [--title TEXT] [--tokens-per-step N]

train_gpt --plot FILE runs this script at the end of a run. Exit code 2 with a one-line message on bad
input (a missing or empty log, a line that is not JSON, an unknown output format).
"""
import argparse
import json
import sys


def fail(msg):
    print(f"plot_log: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--title", default=None)
    ap.add_argument("--tokens-per-step", type=int, default=0, help="tokens per optimizer step (0: steps on the x axis)")
    a = ap.parse_args()
    fmt = a.out.rsplit(".", 1)[-1].lower() if "." in a.out else ""
    if fmt not in ("png", "svg"):
        fail(f"'{a.out}': the output must end in .png or .svg")
    try:
        lines = open(a.log, encoding="utf-8").read().splitlines()
    except OSError as e:
        fail(f"cannot read '{a.log}': {e.strerror}")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{a.log}:{n}: not a JSON line ({e.msg})")
        if not isinstance(r, dict) or "step" not in r or "loss" not in r:
            fail(f"{a.log}:{n}: a log line needs \"step\" and \"loss\"")
        rows.append(r)
    if not rows:
        fail(f"'{a.log}' holds no step")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = a.tokens_per_step if a.tokens_per_step > 0 else 1
    xlabel = "tokens" if a.tokens_per_step > 0 else "optimizer step"
    x = [r["step"] * scale for r in rows]
    fig, (ax_loss, ax_lr, ax_speed) = plt.subplots(3, 1, figsize=(8, 9), sharex=True,
                                                    gridspec_kw={"height_ratios": [3, 1, 1]})
    ax_loss.plot(x, [r["loss"] for r in rows], color="tab:blue", alpha=0.35, linewidth=0.8, label="train loss (step)")
    ema, smooth = None, []
    for r in rows:  # the trainer's progress-line average
        ema = r["loss"] if ema is None else 0.9 * ema + 0.1 * r["loss"]
        smooth.append(ema)
    ax_loss.plot(x, smooth, color="tab:blue", linewidth=1.6, label="train loss (moving average)")
    val = [(r["step"] * scale, r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax_loss.plot([v[0] for v in val], [v[1] for v in val], "o-", color="tab:orange", linewidth=1.6, label="validation loss")
    ax_loss.set_ylabel("loss (nats / token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_lr.plot(x, [r.get("lr", float("nan")) for r in rows], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    ax_speed.plot(x, [r.get("tokens_per_s", float("nan")) for r in rows], color="tab:purple")
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_xlabel(xlabel)
    ax_speed.grid(alpha=0.3)
    fig.suptitle(a.title or f"{a.log}: {len(rows)} steps")
    fig.tight_layout()
    try:
        fig.savefig(a.out, format=fmt, dpi=110)
    except OSError as e:
        fail(f"cannot write '{a.out}': {e.strerror}")
    print(f"plot_log: wrote {a.out} ({len(rows)} steps, {len(val)} validations)")


if __name__ == "__main__":
    main()

"""The learning target of asynchronous RL (docs/distributed.md, issue 46) from the runs `scripts/gpu.sh asynclearn`
trains: the held-out arith gain (trained - base) of the async split with staleness 1 against synchronous DDP on
the same GPUs, mean and 95% interval over seeds, and the training reward per step of each arm.

    python3 scripts/async_learning_target.py DIR [--out target.json]

DIR holds one run directory per arm and seed, named ``async_s<seed>`` and ``sync_s<seed>``, each with the
`qerl eval arith` results of its base model and of its last checkpoint and its ``train/metrics.jsonl``. The
target is met when the async arm's mean gain lies inside the synchronous arm's 95% interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tools_target import accuracy

from qerl_cli.bench.stats import mean_ci, welch_ci
from qerl_cli.metricsfile import read_metrics

ARMS = ("async", "sync")
RUN = re.compile(r"^(async|sync)_s(\d+)$")


def rewards(run: Path) -> list[float]:
    """The training reward of each step, in step order (the metrics file's lines that carry one)."""
    rows = read_metrics(run / "train" / "metrics.jsonl")
    return [float(r["reward"]) for r in sorted(rows, key=lambda r: r["step"]) if "reward" in r]


def summarize(root: Path) -> dict:
    raw: dict[str, dict[str, list]] = {a: {"seed": [], "base": [], "trained": [], "gain": [], "reward": []}
                                       for a in ARMS}
    for run in sorted(p for p in root.iterdir() if p.is_dir() and RUN.match(p.name)):
        arm, seed = RUN.match(run.name).groups()
        base, trained = accuracy(run, "base"), accuracy(run, "step")
        d = raw[arm]
        d["seed"].append(int(seed))
        d["base"].append(base)
        d["trained"].append(trained)
        d["gain"].append(None if base is None or trained is None else trained - base)
        d["reward"].append(rewards(run))
    out: dict = {"arms": {}, "raw": raw}
    for arm, d in raw.items():
        steps = max((len(r) for r in d["reward"]), default=0)
        out["arms"][arm] = {k: mean_ci(d[k]) for k in ("base", "trained", "gain")}
        out["arms"][arm]["reward_per_step"] = [
            mean_ci([r[i] for r in d["reward"] if len(r) > i])["mean"] for i in range(steps)]
    s, a = out["arms"]["sync"]["gain"], out["arms"]["async"]["gain"]
    out["async_minus_sync_gain"] = welch_ci([v for v in raw["async"]["gain"] if v is not None],
                                            [v for v in raw["sync"]["gain"] if v is not None])
    out["met"] = None if s["lo"] is None or a["mean"] is None else s["lo"] <= a["mean"] <= s["hi"]
    return out


def pct(ci: dict, sign: str = "") -> str:
    mean = "-" if ci["mean"] is None else f"{100 * ci['mean']:{sign}.1f}"
    interval = f"[{100 * ci['lo']:.1f}, {100 * ci['hi']:.1f}]" if ci["lo"] is not None else "(no interval)"
    return f"{mean} {interval}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = summarize(args.root)
    for arm, d in res["arms"].items():
        n = d["gain"]["n"]
        curve = d["reward_per_step"] or [None]
        first, last = ("-" if r is None else f"{r:.3f}" for r in (curve[0], curve[-1]))
        print(f"{arm:5s} held-out accuracy % base {pct(d['base'])}, trained {pct(d['trained'])}, gain "
              f"{pct(d['gain'], '+')} points over {n} seeds; reward first step {first}, last {last}")
    diff = res["async_minus_sync_gain"]
    if diff["diff"] is not None:
        interval = f"[{100 * diff['lo']:.1f}, {100 * diff['hi']:.1f}]" if diff["lo"] is not None else "(no interval)"
        print(f"async - sync gain: {100 * diff['diff']:+.1f} points {interval}; target (async mean gain inside "
              f"sync's interval) { {True: 'met', False: 'MISSED', None: 'undecided'}[res['met']] }")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    missing = [f"{arm}_s{seed}" for arm, d in res["raw"].items() for seed, g in zip(d["seed"], d["gain"], strict=True)
               if g is None]
    if missing or not all(res["raw"][a]["seed"] for a in ARMS):  # a failed run must fail the stage
        print(f"no result for: {', '.join(missing) or 'an arm'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

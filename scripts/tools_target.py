"""The arith-with-a-calculator target (docs/tools.md) from the runs `scripts/gpu.sh tools` trains: held-out arith
accuracy with the calculator vs the same training without it, mean and 95% interval over seeds.

    python3 scripts/tools_target.py DIR [--out target.json]

DIR holds one run directory per arm and seed, named ``tool_s<seed>`` and ``plain_s<seed>``, each with the
`qerl eval arith` results of its base model and of its last checkpoint (the tool arm's with ``--tools
calculator``: ``eval/arith-base-calculator[-<settings>].json``, ``eval/arith-step_N-calculator[-<settings>].json``,
the settings that differ from the default named at the end, e.g. ``-limit100-n8``). The target is met when
the 95% Welch interval of (tool - plain) trained accuracy lies above 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from qerl_cli.bench.stats import mean_ci, welch_ci

RUN = re.compile(r"^(tool|plain)_s(\d+)$")


def accuracy(run: Path, checkpoint: str) -> float | None:
    """The primary arith accuracy of one eval result of ``run`` ("base" or the last "step_N"), None if absent."""
    results = []
    for f in (run / "eval").glob("arith-*.json"):
        if f.name.endswith(".samples.jsonl"):
            continue
        m = re.match(r"^arith-(base|step_(\d+))(-calculator)?(?:-[a-z]+[0-9.]*)*\.json$", f.name)
        if m and (checkpoint == "base") == (m.group(1) == "base"):
            results.append((int(m.group(2) or 0), f))
    if not results:
        return None
    data = json.loads(max(results)[1].read_text())
    return float(data["scores"][data["primary"]]["accuracy"]["mean"])


def summarize(root: Path) -> dict:
    arms: dict[str, dict[str, list[float | None]]] = {"tool": {"base": [], "trained": []},
                                                       "plain": {"base": [], "trained": []}}
    seeds: dict[str, list[int]] = {"tool": [], "plain": []}
    for run in sorted(p for p in root.iterdir() if p.is_dir() and RUN.match(p.name)):
        arm, seed = RUN.match(run.name).groups()
        seeds[arm].append(int(seed))
        arms[arm]["base"].append(accuracy(run, "base"))
        arms[arm]["trained"].append(accuracy(run, "step"))
    out = {"seeds": seeds, "arms": {a: {k: mean_ci(v) for k, v in d.items()} for a, d in arms.items()},
           "raw": arms}
    diff = welch_ci([v for v in arms["tool"]["trained"] if v is not None],
                    [v for v in arms["plain"]["trained"] if v is not None])
    out["tool_minus_plain"] = diff
    out["met"] = None if diff["lo"] is None else diff["lo"] > 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = summarize(args.root)
    for arm, d in res["arms"].items():
        for k, ci in d.items():
            lo, hi = ci["lo"], ci["hi"]
            interval = f"[{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "(one seed: no interval)"
            mean = "-" if ci["mean"] is None else f"{100 * ci['mean']:.1f}%"
            print(f"{arm:5s} {k:7s} held-out arith accuracy {mean} {interval} over {ci['n']} seeds")
    d = res["tool_minus_plain"]
    if d["diff"] is not None:
        interval = f"[{100 * d['lo']:.1f}, {100 * d['hi']:.1f}]" if d["lo"] is not None else "(no interval)"
        print(f"tool - plain (trained): {100 * d['diff']:+.1f} points {interval}; target "
              f"{ {True: 'met', False: 'MISSED', None: 'undecided'}[res['met']] }")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    missing = [f"{arm}_s{seed} {k}" for arm, d in res["raw"].items() for k, values in d.items()
               for seed, v in zip(res["seeds"][arm], values, strict=True) if v is None]
    if missing:  # a run that failed must fail the stage, not shrink the interval
        print(f"no result for: {', '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

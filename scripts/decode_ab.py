"""The issue-25 A/B table from `scripts/gpu_rollout.sh` stages d7/d32: QERL_FUSED_LORA=1 QERL_FUSED_SAMPLING=1 against
QERL_FUSED_LORA=0 QERL_FUSED_SAMPLING=0, per shape, format and batch (LoRA r32 on), and the new path's LoRA and
sampling shares of the step.

Usage: python3 decode_ab.py DIR... where each DIR holds on_<fmt>/rollout.json and off_<fmt>/rollout.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cells(path: Path) -> dict[tuple[str, int, str], dict]:
    if not path.is_file():
        return {}
    res = json.loads(path.read_text())
    out = {}
    for c in res["results"]:
        if c.get("status", "").startswith("ok") and c.get("mode") == "fixed":
            out[(c["format"], c["batch"], c.get("lora", "on"))] = dict(c, shape=res.get("shape"))
    shares = {(s["format"], s["batch"]): s for s in res.get("lora_shares", [])}
    for (fmt, b, lora), c in out.items():
        if lora == "on" and (fmt, b) in shares:
            c["lora_share"] = shares[(fmt, b)]["share_pct"]
    return out


def f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def main() -> None:
    print("== issue 25 A/B: QERL_FUSED_LORA=1 QERL_FUSED_SAMPLING=1 (\"new\") vs both 0; LoRA r32 on")
    print(f"{'shape':12} {'fmt':6} {'batch':>5} {'ms/step new':>11} {'A/B off':>8} {'speed-up':>8} {'graph new':>9} "
          f"{'graph off':>9} {'LoRA %':>7} {'sampl ms':>8} {'sampl %':>7} {'% roof':>7}")
    for d in (Path(a) for a in sys.argv[1:]):
        for on_path in sorted(d.glob("on_*/rollout.json")):
            on = cells(on_path)
            off = cells(on_path.parent.parent / on_path.parent.name.replace("on_", "off_", 1) / "rollout.json")
            for (fmt, b, lora), c in sorted(on.items()):
                if lora != "on":
                    continue
                o = off.get((fmt, b, "on"), {})
                p, po = c.get("profile") or {}, o.get("profile") or {}
                ms, ms_off = c.get("decode_ms_per_step"), o.get("decode_ms_per_step")
                sp = ms_off / ms if ms and ms_off else None
                g, g_off = p.get("graph_step_ms"), po.get("graph_step_ms")
                samp = (p.get("ms_per_step") or {}).get("sampling")
                samp_pct = 100 * samp / g if samp is not None and g else None
                print(f"{c['shape'] or '':12} {fmt:6} {b:>5} {f(ms):>11} {f(ms_off):>8} {f(sp, '{:.2f}x'):>8} "
                      f"{f(g):>9} {f(g_off):>9} {f(c.get('lora_share'), '{:.1f}'):>7} {f(samp, '{:.3f}'):>8} "
                      f"{f(samp_pct, '{:.1f}'):>7} {f(c.get('pct_roofline'), '{:.1f}'):>7}")


if __name__ == "__main__":
    main()

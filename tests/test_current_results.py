"""docs/benchmarks.md's "Current results" block is what scripts/current_results.py makes of the raw files under
docs/results/ (named in docs/results/index.json): a figure edited by hand, or a raw file that changed, fails here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():  # noqa: ANN202 - the module
    spec = importlib.util.spec_from_file_location("current_results", ROOT / "scripts" / "current_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_page_holds_exactly_what_the_raw_files_give() -> None:
    cr = _script()
    block = cr.current_block((ROOT / "docs" / "benchmarks.md").read_text())
    assert block is not None, "docs/benchmarks.md has no current-results block: run python scripts/current_results.py"
    assert block == cr.render(json.loads(cr.INDEX.read_text())), \
        "docs/benchmarks.md's current results differ from docs/results/: run python scripts/current_results.py"


def test_every_index_entry_names_a_raw_file_a_command_and_targets() -> None:
    cr = _script()
    index = json.loads(cr.INDEX.read_text())
    assert {b["bench"] for b in index["benches"]} >= {"kernels", "rollout", "step", "mismatch", "scale", "evidence"}
    for bench in index["benches"]:
        for entry in bench["entries"]:
            assert (cr.RESULTS / entry["file"]).is_file(), entry["file"]
            assert entry["command"].strip()
            assert entry.get("targets") == "file" or entry["rows"]


def test_a_figure_comes_from_its_raw_file(tmp_path: Path) -> None:
    """Change a number in a copy of a raw file: the regenerated row changes with it, met/missed included."""
    cr = _script()
    index = json.loads(cr.INDEX.read_text())
    results = tmp_path / "results"
    shutil.copytree(cr.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "*.tgz", "*.log", "*.txt"))
    before = cr.render(index, results)
    row = "| 2 GPUs: tokens/s per GPU over 1 GPU's | {} | >= 90.0% | {} | 4 x NVIDIA H200 | 2026-11-22 | [1] |"
    assert row.format("98.8%", "**met**") in before
    raw = json.loads((results / "2026-11-22" / "scale.json").read_text())
    raw["table"][1]["efficiency"] = 0.55
    (results / "2026-11-22" / "scale.json").write_text(json.dumps(raw))
    after = cr.render(index, results)
    assert row.format("55.0%", "missed") in after


def test_a_ratio_may_read_its_denominator_from_another_raw_file(tmp_path: Path) -> None:
    """The 32B 8 x 8 cell's rollout tokens/s over the 1 x 8 cell's: halve the other file's figure, the ratio doubles."""
    cr = _script()
    index = json.loads(cr.INDEX.read_text())
    results = tmp_path / "results"
    shutil.copytree(cr.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "*.tgz", "*.log", "*.txt", "*.md"))
    big = json.loads((results / "2026-11-29" / "s52_step32b_8x8_h200.json").read_text())["results"][0]
    small_file = results / "2026-11-29" / "s52_step32b_1x8_h200.json"
    small = json.loads(small_file.read_text())
    row = "| the same: rollout tokens/s over the 1 x 8 cell's | {:.2f}x | >= 2.50x |"
    assert row.format(big["rollout_tok_s"] / small["results"][0]["rollout_tok_s"]) in cr.render(index, results)
    small["results"][0]["rollout_tok_s"] /= 2
    small_file.write_text(json.dumps(small))
    assert row.format(big["rollout_tok_s"] / small["results"][0]["rollout_tok_s"]) in cr.render(index, results)

"""The wheel ships everything a plain (non-editable) `pip install qerl` needs at run time: the train presets,
the bundled task data and the CUDA sources. (.ci/run also installs that wheel in a fresh venv and runs the default
train.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_presets_and_data(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: no build/ or egg-info left in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("qerl_cli", "kernels"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("qerl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {p.name for p in (ROOT / "qerl_cli" / "templates").glob("*.yaml")}
    assert {"quick_cpu.yaml", "gpu_arith.yaml", "gsm8k_grpo_paper.yaml", "gsm8k_dapo_paper.yaml"} <= presets
    for name in presets:
        assert f"qerl_cli/templates/{name}" in names, name
    assert "qerl_cli/data/gsm8k/test.jsonl" in names and "qerl_kernels/__init__.py" in names
    # the CUDA sources nvcc builds on first use, with every header they include
    for cu in (ROOT / "kernels" / "cuda").iterdir():
        assert f"qerl_kernels/cuda/{cu.name}" in names, cu.name


def test_every_package_is_listed_for_the_wheel() -> None:
    """pyproject lists the packages by name: a new subpackage left out would be missing from a plain install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("qerl_cli", *p.parent.relative_to(ROOT / "qerl_cli").parts))
             for p in (ROOT / "qerl_cli").rglob("__init__.py")}
    assert found - listed == set(), "add to [tool.setuptools] packages"

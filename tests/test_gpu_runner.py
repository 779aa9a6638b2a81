"""scripts/gpu.sh, the one GPU job runner, and scripts/pack_wheels.sh, which packs what it carries: every stage the
docs name exists, and a wheel too large for one call travels in parts over two calls, is joined, checked and
installed (on this CPU machine: the runner's /tmp, carry folder and output folder moved into tmp_path)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "gpu.sh"


def _stages() -> set[str]:
    return set(re.findall(r"^stage_(\w+)\(\)", RUNNER.read_text(), re.M))


def test_scripts_hold_one_gpu_entry_point_whose_header_lists_every_stage() -> None:
    assert sorted(p.name for p in (ROOT / "scripts").glob("*.sh")) == ["gpu.sh", "pack_wheels.sh"]
    text = RUNNER.read_text()
    header = text[:text.index("set -uo pipefail")]
    listed = set(re.findall(r"^#   (\w+) {2,}", header, re.M))
    assert listed == _stages() and {"main", "step", "vllm", "trl", "flashinfer", "scale", "fsdp", "evidence",
                                    "ncu", "gputests"} <= listed


def _prose_files() -> list[Path]:
    """Everything a reader follows to a GPU job: README, docs (not the dated logs), code and tests."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "results").glob("*.json")]
    for folder in ("qerl_cli", "kernels", "tests", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md", ".yaml")]
    return files


def test_every_runner_command_in_the_docs_names_real_stages_and_no_old_script_is_cited() -> None:
    stages, seen = _stages(), 0
    old = re.compile(r"scripts/gpu_[\w*]+\.sh|gpu_common|vllm_pack\.sh|trl_pack\.sh|flashinfer_wheels\.sh")
    command = re.compile(r"scripts/gpu\.sh((?: [a-z][a-z0-9]*)+)(?=[`),;:]|\s*$|\s+#)", re.M)
    for path in _prose_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        assert not old.search(text), f"{path.relative_to(ROOT)} cites a removed script: {old.search(text).group()}"
        for words in command.findall(text):
            assert set(words.split()) <= stages, f"{path.relative_to(ROOT)}: `scripts/gpu.sh{words}` names no stage"
            seen += 1
    assert seen >= 10  # the docs do point at the runner


def _wheel(folder: Path, dist: str, version: str, module: str, payload: bytes = b"") -> Path:
    """A minimal installable wheel whose module prints its version; ``payload`` makes it as large as needed."""
    info = f"{dist}-{version}.dist-info"
    files = {f"{module}/__init__.py": f"__version__ = {version!r}\n".encode(), f"{module}/blob.bin": payload,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(b: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(b)},{len(b)}\n" for n, b in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


def _sh(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_a_wheel_in_parts_is_carried_over_two_calls_joined_checked_and_installed(tmp_path: Path) -> None:
    index, carry, machine = tmp_path / "index", tmp_path / "carry", tmp_path / "machine"
    index.mkdir()
    big = _wheel(index, "flashinfer_python", "0.7.2.post1", "flashinfer", os.urandom(100 << 10))
    _wheel(index, "apache_tvm_ffi", "0.1.15.post2", "tvm_ffi")
    packed = _sh("pack_wheels.sh", "flashinfer", env={"QERL_PACK_FIND_LINKS": str(index), "QERL_CARRY_DIR": str(carry),
                                                     "QERL_PART_KIB": "64"})
    assert packed.returncode == 0, packed.stderr
    a, b = carry / "flashinfer_a", carry / "flashinfer_b"
    assert sorted(p.name for p in carry.iterdir()) == ["flashinfer_a", "flashinfer_b"]
    assert (a / "part_a").stat().st_size == 64 << 10 and (a / "part_a").read_bytes() == big.read_bytes()[:64 << 10]
    assert (b / "name").read_text().strip() == big.name
    assert (b / "sha256").read_text().strip() == hashlib.sha256(big.read_bytes()).hexdigest()
    assert (b / "apache_tvm_ffi-0.1.15.post2-py3-none-any.whl").is_file()

    calls = iter(range(10))

    def call(carried: Path | None, *stages: str, rc: int = 0) -> str:  # one device call: only `carried` travels
        out = tmp_path / "calls" / str(next(calls))
        out.mkdir(parents=True)
        if carried is not None:
            (out / "carry").mkdir()
            subprocess.run(["cp", "-r", str(carried), str(out / "carry")], check=True)
        res = _sh("gpu.sh", *stages, env={"QERL_GPU_TMP": str(machine), "QERL_CARRY_DIR": str(out / "carry"),
                                          "OUT": str(out / "out")})
        assert res.returncode == rc, res.stdout + res.stderr
        return res.stdout

    first = call(a, "flashinfer", rc=1)  # part A alone: stashed, nothing to install yet
    assert "stashed flashinfer_a" in first and "flashinfer: no parts or no name/sha256 stashed" in first
    assert "stage flashinfer failed" in first
    second = call(b, "flashinfer")
    assert "stashed flashinfer_b" in second and "flashinfer 0.7.2.post1\n" in second
    site = machine / "site"
    assert (site / "flashinfer" / "blob.bin").stat().st_size == 100 << 10 and (site / "tvm_ffi").is_dir()
    assert "flashinfer 0.7.2.post1\n" in call(None, "flashinfer")  # installed once: a later call only checks it

    (machine / "site" / ".qerl-flashinfer").unlink()  # a part from another pack is refused by name, not installed
    (machine / "qerl_stash" / "flashinfer_a" / "part_a").write_bytes(b"x" * (64 << 10))
    refused = call(None, "flashinfer", rc=1)
    assert "flashinfer: the joined parts (part_a part_b ) do not match its sha256" in refused
    assert "stage flashinfer failed" in refused


def test_an_unknown_stage_stops_the_call_before_any_stage_runs(tmp_path: Path) -> None:
    res = _sh("gpu.sh", "info", "nonsense", env={"QERL_GPU_TMP": str(tmp_path), "QERL_CARRY_DIR": str(tmp_path / "c"),
                                                 "OUT": str(tmp_path / "out")})
    assert res.returncode == 2 and "unknown stage nonsense" in res.stdout and "stage info" not in res.stdout


def _runner_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The runner as a GPU call starts it: its own /tmp, carry and output folders, no stage settings given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QERL_GPU_TEST", "TRITON_INTERPRET"))}
    return {**env, "QERL_GPU_TMP": str(tmp_path / "machine"), "QERL_CARRY_DIR": str(tmp_path / "carry"),
            "OUT": str(tmp_path / "out"), **extra}


def test_gputests_and_selfcheck_run_with_their_defaults_and_the_exit_status_tells(tmp_path: Path) -> None:
    res = subprocess.run(["bash", str(RUNNER), "gputests", "selfcheck"], capture_output=True, text=True,
                         timeout=600, env=_runner_env(tmp_path))
    text = res.stdout + res.stderr
    assert "unbound variable" not in text and "not found" not in text, text[-3000:]
    # the default test file, found from the runner's /tmp: collected, and skipped here for want of a GPU
    log = (tmp_path / "out" / "gputests" / "0.log").read_text()
    assert re.search(r"\d+ skipped", log) and "error" not in log.lower(), log[-2000:]
    assert "stage gputests failed" not in text
    # the self-check imports every kernel path and refuses, in one line, to check without a GPU
    assert "kernel_selfcheck: no CUDA GPU here" in text and "Traceback" not in text
    assert "stage selfcheck failed (rc 2)" in text and "failed: selfcheck" in text and res.returncode == 1


def test_gputests_fails_when_a_test_fails_and_reads_paths_relative_to_the_checkout(tmp_path: Path) -> None:
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_pass.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (tests / "test_fail.py").write_text("def test_bad():\n    assert 1 + 1 == 3\n")
    ok = subprocess.run(["bash", str(RUNNER), "gputests"], capture_output=True, text=True, timeout=300,
                        env=_runner_env(tmp_path, QERL_GPU_TESTS=str(tests / "test_pass.py"),
                                        QERL_GPU_TEST_ENVS="A=1; A=2"))
    assert ok.returncode == 0 and ok.stdout.count("1 passed") == 2, ok.stdout[-2000:]
    bad = subprocess.run(["bash", str(RUNNER), "gputests"], capture_output=True, text=True, timeout=300,
                         env=_runner_env(tmp_path, QERL_GPU_TESTS=f"{tests / 'test_pass.py'} {tests / 'test_fail.py'}"))
    assert bad.returncode == 1 and "stage gputests failed (rc 1)" in bad.stdout and "1 failed, 1 passed" in bad.stdout
    rel = subprocess.run(["bash", str(RUNNER), "gputests"], capture_output=True, text=True, timeout=300,
                         env=_runner_env(tmp_path, QERL_GPU_TESTS="tests/test_no_such_file.py"))
    assert str(ROOT / "tests" / "test_no_such_file.py") in (tmp_path / "out" / "gputests" / "0.log").read_text()
    assert rel.returncode == 1


def test_bench_sets_take_their_own_environment_and_keep_their_results_two_folders_deep(tmp_path: Path) -> None:
    """QERL_BENCH_ENVS: the i-th setting for the i-th argument set only (a W4A8 set beside the default one in one
    stage), its results at $OUT/<stage>/<i>/, which the device tool brings back (OUT=$OUT/x nested them too deep)."""
    fn = re.search(r"^bench_stage\(\) \{\n.*?^\}\n", RUNNER.read_text(), re.M | re.S)
    assert fn is not None
    script = tmp_path / "bench.sh"
    script.write_text("stamp() { :; }\nbudget() { echo 100; }\n"
                      'qerl() { echo "$3 ${*:4} W4A8=${QERL_W4A8:-unset} X=${X:-unset}"; }\n' + fn.group(0)
                      + 'QERL_BENCH_ENVS="; QERL_W4A8=1 X=2" bench_stage rollout "--a 1;--a 2"\n'
                      + 'echo "after W4A8=${QERL_W4A8:-unset}"\n')
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"rollout --a 1 --out {tmp_path}/out/rollout/1 W4A8=unset X=unset",
        f"rollout --a 2 --out {tmp_path}/out/rollout/2 W4A8=1 X=2",
        "after W4A8=unset"]

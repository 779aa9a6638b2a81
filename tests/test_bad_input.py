"""Bad input found by a fault tour, each one line and exit 2 (no traceback, no hang, no exit 0 on nonsense), and
nothing written that a later stage would trust:

* a checkpoint that lacks a tensor its architecture needs is refused by `qerl quantize` (no random weights);
* absurd model configs (sizes, heads, experts, strings, NaN) are refused before anything is allocated, and a
  run's `model/config.json` is covered by the run's hashes;
* `qerl eval`'s numeric options are checked (finite, in range, below a sane maximum);
* a FIFO where a run's JSON file belongs, a hard-linked lock file, an over-long path, a bad `--ignore` pattern,
  the benches' bad lists and devices;
* a torn metrics row that a checkpoint covers is dropped with a warning naming the file and line;
* a failed or interrupted `quantize --force` gives the quantize stage its earlier record back; a full disk in
  `qerl eval` is recorded as the failure; each stage's Ctrl-C hint is its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import deadline, qerl_in_process


def assert_one_line(code: int, err: str, *needles: str) -> str:
    """The single `error: ...` line of a refused command (exit 2), containing every needle."""
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def without_tensor(src: Path, dst: Path, name: str) -> Path:
    """A copy of the model directory ``src`` whose safetensors file lacks the tensor ``name``."""
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    state = load_file(str(weights))
    del state[name]
    save_file(state, str(weights), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def base_run(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model quantized (NVFP4) once for this module; tests work on copies (``run``)."""
    from qerl_cli.quantize import quantize_model

    run = tmp_path_factory.mktemp("bad_input") / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    return run


@pytest.fixture
def run(base_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock")))


# ---- a checkpoint missing a tensor -----------------------------------------------------------------------------
def test_quantize_refuses_a_checkpoint_missing_a_tensor(tiny_source: Path, tmp_path: Path, capsys) -> None:
    src = without_tensor(tiny_source, tmp_path / "src", "model.layers.1.mlp.down_proj.weight")
    run = tmp_path / "run"
    code, _, err = qerl_in_process(capsys, "quantize", str(src), "--run", str(run))
    assert_one_line(code, err, "lacks 1 tensor(s)", "model.layers.1.mlp.down_proj.weight", "complete checkpoint")
    assert not run.exists()  # the run this command created goes again: nothing for eval or train to trust


def test_quantize_refuses_a_missing_tensor_over_a_quantized_run_and_keeps_its_record(tiny_source: Path, run: Path,
                                                                                      tmp_path: Path, capsys) -> None:
    before = (run / "manifest.json").read_bytes()
    src = without_tensor(tiny_source, tmp_path / "src", "model.norm.weight")
    code, _, err = qerl_in_process(capsys, "quantize", str(src), "--run", str(run))
    assert_one_line(code, err, "model.norm.weight")
    assert (run / "manifest.json").read_bytes() == before


# ---- absurd model configs ----------------------------------------------------------------------------------------
def moe_config(tiny_source: Path) -> dict:
    """A tiny Qwen3-MoE config.json (8 experts, 2 per token) with the tiny model's vocabulary."""
    from transformers import Qwen3MoeConfig

    vocab = json.loads((tiny_source / "config.json").read_text())["vocab_size"]
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2).to_dict()


BAD_CONFIGS = [  # (base, field, value, what the line says)
    ("llama", "num_hidden_layers", 1e9, "num_hidden_layers is 1000000000.0, not a whole number from 1 to 1024"),
    ("llama", "num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, not a whole number from 1 to 1024"),
    ("llama", "hidden_size", -64, "hidden_size is -64, not a whole number from 1 to 131072"),
    ("llama", "num_attention_heads", 0, "num_attention_heads is 0, not a whole number from 1 to 1024"),
    ("llama", "vocab_size", "49152", "vocab_size is '49152', not a whole number"),
    ("llama", "rms_norm_eps", float("nan"), "rms_norm_eps is not a finite number"),
    ("llama", "num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("moe", "num_experts", 1e9, "num_experts is 1000000000.0, not a whole number from 0 to 4096"),
    ("moe", "num_experts_per_tok", 9, "num_experts_per_tok 9 is above the 8 experts per layer"),
    ("moe", "num_experts", 4096, "describes about 5.3e+13 parameters"),
]


@pytest.mark.parametrize(("base", "field", "value", "says"), BAD_CONFIGS,
                         ids=[f"{b}-{f}-{v}" for b, f, v, _ in BAD_CONFIGS])
def test_quantize_refuses_an_absurd_config_before_building_anything(tiny_source: Path, tmp_path: Path, capsys,
                                                                     base: str, field: str, value: object,
                                                                     says: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    cfg = json.loads((src / "config.json").read_text()) if base == "llama" else moe_config(tiny_source)
    cfg[field] = value
    if field == "num_experts" and value == 4096:
        cfg.update(hidden_size=8192, moe_intermediate_size=8192, num_hidden_layers=64, head_dim=128)
    (src / "config.json").write_text(json.dumps(cfg))  # NaN written as JSON's NaN, which Python's reader accepts
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "quantize", str(src), "--run", str(tmp_path / "run"))
    assert_one_line(code, err, f"{src / 'config.json'}: " if "parameters" not in says else str(src), says)
    assert not (tmp_path / "run").exists()


def test_real_model_configs_pass() -> None:
    """The limits leave every shape the benches build (up to Qwen2.5-72B and Qwen3-30B-A3B) alone."""
    from qerl_cli.bench.shapes import SHAPES
    from qerl_cli.model_config import check_config_dict

    for name, shape in SHAPES.items():
        check_config_dict(shape.config().to_dict(), name)


def test_train_refuses_an_absurd_run_config_before_planning(run: Path, capsys) -> None:
    cfg_path = run / "model" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = 10**9
    cfg_path.write_text(json.dumps(cfg))
    before = (run / "manifest.json").read_bytes()
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "train", "--run", str(run), "--steps", "1")
    assert_one_line(code, err, "num_hidden_layers is 1000000000")
    assert (run / "manifest.json").read_bytes() == before


def test_an_edited_run_config_is_detected_like_an_edited_weight(run: Path, capsys) -> None:
    cfg_path = run / "model" / "config.json"
    manifest = json.loads((run / "manifest.json").read_text())
    assert "config.json" in manifest["stages"]["quantize"]["outputs"]["model"]["files"]
    cfg = json.loads(cfg_path.read_text())
    cfg["rms_norm_eps"] = 0.5  # sane, so only the hash can tell
    cfg_path.write_text(json.dumps(cfg))
    code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "base",
                                   "--limit", "1")
    assert_one_line(code, err, f"{cfg_path} does not match the sha256 the manifest recorded")


# ---- eval's numeric options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "says"), [
    (["--temperature", "nan"], "--temperature must be a number from 0 to 100 (0: greedy), got nan"),
    (["--temperature", "inf", "--samples", "2"], "--temperature must be a number from 0 to 100 (0: greedy), got inf"),
    (["--samples", "1000000000"], "--samples must be from 1 to 4096, got 1000000000"),
    (["--max-tokens", "99999999999"], "--max-tokens must be from 1 to 1048576, got 99999999999"),
    (["--shots", "-1"], "--shots must be from 0 to 64, got -1"),
    (["--max-turns", "0", "--tools", "calculator"], "--max-turns must be from 1 to 256, got 0"),
    (["--seed", "-5"], "--seed must be from 0 to 9223372036854775807, got -5"),
])
def test_eval_refuses_bad_numeric_options_before_loading(run: Path, capsys, flags: list[str],
                                                          says: str) -> None:
    before = (run / "manifest.json").read_bytes()
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "base",
                                       *flags)
    assert_one_line(code, err, says)
    assert (run / "manifest.json").read_bytes() == before and not (run / "eval").exists()


# ---- non-regular files in a run ------------------------------------------------------------------------------------
def test_a_fifo_for_the_manifest_is_refused_by_eval_not_waited_on(run: Path, capsys) -> None:
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "base")
    assert_one_line(code, err, f"{run / 'manifest.json'} is a FIFO, not a regular file")


def test_a_fifo_among_the_eval_results_is_refused_by_report(run: Path, capsys) -> None:
    (run / "eval").mkdir()
    os.mkfifo(run / "eval" / "arith-base.json")
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "report", "--run", str(run))
    assert_one_line(code, err, f"{run / 'eval' / 'arith-base.json'} is a FIFO, not a regular file")
    assert not (run / "report" / "index.html").exists()


def test_a_fifo_for_the_metrics_is_refused_by_resume(run: Path, capsys) -> None:
    (run / "train").mkdir()
    os.mkfifo(run / "train" / "metrics.jsonl")
    with deadline(60):
        code, _, err = qerl_in_process(capsys, "train", "--run", str(run), "--resume", "--steps", "1")
    assert_one_line(code, err, f"{run / 'train' / 'metrics.jsonl'} is a FIFO, not a regular file")


def test_a_hard_linked_lock_is_refused_and_the_other_file_is_unchanged(run: Path, tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.link(victim, run / ".lock")
    before = (run / "manifest.json").read_bytes()
    code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "base", "--limit", "1")
    assert_one_line(code, err, f"{run / '.lock'} is a hard link (2 names for one file)")
    assert victim.read_text() == "keep me\n" and (run / "manifest.json").read_bytes() == before


# ---- paths, patterns, lists and devices ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["quantize", "eval", "train", "report"])
def test_a_path_too_long_for_the_file_system_is_one_line(tmp_path: Path, capsys, command: str) -> None:
    long = tmp_path / ("x" * 300)
    args = {"eval": ["eval", "arith"], "train": ["train", "--steps", "1"]}.get(command, [command])
    code, _, err = qerl_in_process(capsys, *args, "--run", str(long))
    assert_one_line(code, err, "a name in this path is longer than the file system allows", "use a shorter path")
    assert list(tmp_path.iterdir()) == []


def test_quantize_refuses_a_bad_ignore_pattern_before_loading(tiny_source: Path, tmp_path: Path, capsys) -> None:
    code, _, err = qerl_in_process(capsys, "quantize", str(tiny_source), "--run", str(tmp_path / "run"),
                                   "--ignore", "re:(")
    assert_one_line(code, err, "--ignore 're:(' is not a valid regular expression (missing ), unterminated subpattern")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "says"), [
    (["kernels", "--m", "a"], "--m takes comma-separated whole numbers >= 1 (e.g. --m 1,8), got 'a' in 'a'"),
    (["kernels", "--m", "1,0"], "--m takes comma-separated whole numbers >= 1 (e.g. --m 1,8), got '0' in '1,0'"),
    (["rollout", "--shape", "tiny", "--batches", "a"], "--batches takes comma-separated whole numbers >= 1"),
    (["mismatch", "--device", "tpu"], "--device tpu is not a device qerl runs on: use cpu or cuda"),
])
def test_bench_refuses_bad_lists_and_devices(tmp_path: Path, capsys, args: list[str], says: str) -> None:
    code, _, err = qerl_in_process(capsys, "bench", *args, "--out", str(tmp_path / "out"))
    assert_one_line(code, err, says)
    assert not (tmp_path / "out").exists()


def test_a_profile_trace_goes_through_a_fresh_private_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--profile` reads the profiler's trace back from a file: a fresh one (mkstemp, mode 0600), removed after, never
    a fixed name in the shared temporary folder."""
    import tempfile

    import torch

    from qerl_cli.bench.decode_profile import chrome_trace

    shared = tmp_path / "shared_tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    seen: list[tuple[str, int]] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    export = prof.export_chrome_trace

    def watched(path: str) -> None:
        seen.append((path, os.stat(path).st_mode & 0o777))
        export(path)

    monkeypatch.setattr(prof, "export_chrome_trace", watched)
    trace = chrome_trace(prof)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    ((path, mode),) = seen
    assert Path(path).parent == shared and Path(path).name.startswith("qerl_trace_") and mode == 0o600
    assert not Path(path).exists()


# ---- a trained run: torn metrics, re-quantize failures, a full disk, Ctrl-C -------------------------------------
TRAIN = {"steps": 2, "save_steps": 1, "batch_prompts": 2, "num_generations": 4, "max_completion_length": 4,
         "shots": 0, "lora_rank": 4, "micro_batch_size": 8, "seed": 3}
REWARD = ("import hashlib\n\n\ndef text_hash(prompts, completions, **kw):\n"
          "    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 16**8 for c in completions]\n")


@pytest.fixture(scope="module")
def trained(base_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``base_run`` trained 2 steps (a checkpoint each) with a reward that differs per completion; its flags."""
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    root = tmp_path_factory.mktemp("bad_input_trained")
    (root / "reward.py").write_text(REWARD)
    overrides = {**TRAIN, "reward": f"{root / 'reward.py'}:text_hash", "log_rollouts": False}
    run = Path(shutil.copytree(base_run, root / "run", ignore=shutil.ignore_patterns(".lock")))
    assert train(run, build_config("quick_cpu", overrides)).steps_done == 2
    flags = ["--config", "quick_cpu"] + [a for k, v in overrides.items() if k != "log_rollouts"
                                         for a in (f"--{k.replace('_', '-')}", str(v))]
    return {"run": run, "flags": flags}


@pytest.fixture
def trained_run(trained: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained["run"], tmp_path / "trained", ignore=shutil.ignore_patterns(".lock")))


def test_resume_warns_of_a_checkpointed_metrics_row_torn_by_hand(trained: dict, trained_run: Path, capsys,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """One warning line (the `qerl.metrics` logger: printed on stderr by the CLI, captured by pytest here)."""
    from qerl_cli.metricsfile import read_metrics

    metrics = trained_run / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    metrics.write_text(lines[0] + "\n" + lines[1][:30])  # step 2's row, which checkpoint step_2 covers, cut by hand
    code, _, err = qerl_in_process(capsys, "train", "--run", str(trained_run), *trained["flags"], "--steps", "3",
                                   "--resume")
    assert code == 0, err[-3000:]
    warnings = [r.getMessage() for r in caplog.records if r.name == "qerl.metrics"]
    assert warnings == [f"warning: {metrics} line 2 is cut short (not a whole JSON record) and is dropped: it held "
                        "step 2, which the checkpoint of step 2 covers, so those metrics are lost (restore the line "
                        "from a copy to keep them)"]
    assert [r["step"] for r in read_metrics(metrics)] == [1, 3]


def test_a_torn_row_of_a_step_no_checkpoint_covers_is_dropped_quietly(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from qerl_cli.metricsfile import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')  # a kill while appending step 2's row
    assert read_metrics(path, covered=1) == [{"step": 1, "loss": 0.5}] and caplog.records == []
    path.write_text('{"step": 1, "loss": 0.5}\n{"st')  # too short to say its step: reported
    assert read_metrics(path, covered=1) == [{"step": 1, "loss": 0.5}]
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: {path} line 2 is cut short (not a whole JSON record) and is dropped: it held no step qerl can "
        "read, so those metrics are lost (restore the line from a copy to keep them)"]


@pytest.mark.parametrize("how", ["interrupted", "failed"])
def test_a_forced_requantize_that_stops_before_replacing_the_model_keeps_the_quantize_record(
        trained_run: Path, tiny_source: Path, capsys, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    import qerl_cli.quantize as quantize

    manifest = json.loads((trained_run / "manifest.json").read_text())
    before = manifest["stages"]["quantize"]
    model = {p.name: p.read_bytes() for p in (trained_run / "model").iterdir()}

    def stop(*_: object, **__: object) -> None:
        raise KeyboardInterrupt if how == "interrupted" else RuntimeError("the machine failed")

    monkeypatch.setattr(quantize, "save_tensors", stop)
    code, _, err = qerl_in_process(capsys, "quantize", str(tiny_source), "--run", str(trained_run), "--force")
    assert code == (130 if how == "interrupted" else 1), err
    if how == "interrupted":
        assert "the run's model was not replaced" in err and "--resume" not in err
    after = json.loads((trained_run / "manifest.json").read_text())
    assert after["stages"]["quantize"] == before  # the record of the model still in place
    assert after["history"][-1]["stage"] == "quantize" and after["history"][-1]["status"] == how
    assert {p.name: p.read_bytes() for p in (trained_run / "model").iterdir()} == model
    assert (trained_run / "train" / "checkpoints" / "step_2").is_dir()
    monkeypatch.undo()
    code, out, err = qerl_in_process(capsys, "eval", "arith", "--run", str(trained_run), "--limit", "2",
                                     "--max-tokens", "2", "--json")
    assert code == 0, err  # the run (model and adapter) is still whole
    assert json.loads(out)["checkpoint"]["name"] == "step_2"


def test_ctrl_c_in_eval_suggests_running_eval_again(run: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl_cli.eval.harness as harness

    def stop(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "aggregate", stop)
    code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "base", "--limit", "1",
                                   "--max-tokens", "2")
    assert code == 130
    assert " ".join(err.split()) == ("interrupted: no result was written and the run's earlier results stand; run "
                                     "the same `qerl eval` command again")
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    # --limit 1 --max-tokens 2 are not the defaults: the result (and its stage) is named by them
    assert stages["eval/arith-base-limit1-max2"]["status"] == "interrupted"


@contextlib.contextmanager
def small_disk(where: Path, megabytes: int) -> Iterator[Path]:
    """A tmpfs of ``megabytes`` mounted at ``where`` (skips where this process may not mount one)."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(disk: Path) -> None:
    """Write into ``disk`` until it is full."""
    with open(disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()


def test_a_disk_that_fills_up_mid_eval_gets_the_eval_recorded_failed(run: Path, tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl_cli.eval.harness as harness

    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    with small_disk(tmp_path / "disk", size // 2**20 + 8) as disk:
        small = Path(shutil.copytree(run, disk / "run"))
        aggregate = harness.aggregate

        def filled_meanwhile(*args: object, **kwargs: object) -> object:
            fill(disk)  # another process fills the disk while the model generates
            return aggregate(*args, **kwargs)

        monkeypatch.setattr(harness, "aggregate", filled_meanwhile)
        code, _, err = qerl_in_process(capsys, "eval", "arith", "--run", str(small), "--checkpoint", "base",
                                       "--limit", "2", "--max-tokens", "2")
        assert_one_line(code, err, "out of disk space while writing", "eval/arith-base")
        rec = json.loads((small / "manifest.json").read_text())["stages"]["eval/arith-base-limit2-max2"]
        assert rec["status"] == "failed" and rec["error"].startswith("out of disk space while writing")
        assert sorted(p.name for p in small.iterdir() if p.name.startswith(".")) == [".lock"]  # no reserve left

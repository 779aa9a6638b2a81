"""--finetune full checkpoints are real checkpoints: `--resume` continues at their step, `keep_checkpoints`
prunes them and `qerl eval` scores their weights.

A restart from step 0 reproduces the same metrics (same seed), so these tests look at the step counter,
the manifest's resumed_from, the optimizer state and the files on disk instead. A tiny random fp32 Llama
with the embedded model's tokenizer keeps them fast.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

SMALL = {"task_level": "1", "batch_prompts": 2, "num_generations": 2, "max_completion_length": 4, "aqn": False,
         "micro_batch_size": 8, "lr": 1e-3, "weight_decay": 0.1, "save_steps": 1, "seed": 5, "finetune": "full",
         "precision": "fp32", "rollout_quant": "int8", "requant_scales": "fixed"}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    from qerl_cli.quantize import quantize_model
    from tests.helpers import tiny_llama

    path = tmp_path_factory.mktemp("fullft")
    quantize_model(path, None, fmt="bf16", loaded=tiny_llama())
    return path


def _manifest_train(run: Path) -> dict:
    manifest = json.loads((run / "manifest.json").read_text())
    return manifest["stages"]["train"] if "stages" in manifest else manifest["train"]


def _tensors(obj):  # noqa: ANN001, ANN202 - nested optimizer state -> flat {path: tensor}
    if isinstance(obj, torch.Tensor):
        return {"": obj.detach().cpu().clone()}
    if isinstance(obj, dict):
        return {f"{k}/{p}": t for k, v in obj.items() for p, t in _tensors(v).items()}
    return {}


def test_resume_continues_at_the_last_step_with_its_optimizer_state(bf16_run: Path, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path / "run"
    shutil.copytree(bf16_run, run, ignore=shutil.ignore_patterns(".lock"))
    train(run, build_config("quick_cpu", {**SMALL, "steps": 2, "keep_checkpoints": 5}))
    ckpts = run / "train" / "checkpoints"
    from qerl_cli.train.checkpointing import load_checkpoint

    saved = load_checkpoint(ckpts / "step_2")
    saved_opt = _tensors(saved["optimizer"]["state"])
    from safetensors.torch import load_file

    saved_weights = load_file(str(ckpts / "step_2" / "weights.safetensors"))  # pruned by the resumed run
    assert saved_opt and saved["step"] == 2 and saved["rollout_quant"]["fixed_scales"]

    seen: dict = {}

    def at_setup(t) -> None:  # noqa: ANN001 - the Trainer, right after resume(), before any new step
        seen["step"] = t.step
        seen["opt"] = _tensors(t.optimizer.state_dict()["state"])
        seen["scales"] = {n: ql.weight_scale.detach().clone() for n, ql in t.rollout_quant.layers.items()}
        seen["weights"] = {n: m.detach().clone() for n, m in t.full.masters.items()}

    res = train(run, build_config("quick_cpu", {**SMALL, "steps": 4, "keep_checkpoints": 2}), resume=True,
                on_setup=at_setup)
    assert seen["step"] == 2  # a silent restart reads 0 here
    assert seen["opt"].keys() == saved_opt.keys()
    for k, t in saved_opt.items():
        assert torch.equal(seen["opt"][k], t), k  # Adam's exp_avg/exp_avg_sq/step, not a fresh optimizer
    for n, t in saved_weights.items():
        assert torch.equal(seen["weights"][n], t), n
    assert seen["scales"].keys() == saved["rollout_quant"]["scales"].keys()
    for n, s in saved["rollout_quant"]["scales"].items():  # FlashRL fixed INT8 scales: the calibrated ones
        assert torch.equal(seen["scales"][n], s), n
    assert [m["step"] for m in res.metrics] == [3, 4]
    rec = _manifest_train(run)
    assert rec["metrics"]["resumed_from"] == 2 and rec["metrics"]["steps_done"] == 4
    steps = [json.loads(x)["step"] for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert rec["outputs"]["checkpoint"].endswith("step_4") and "weights_sha256" in rec["outputs"]


def test_keep_checkpoints_prunes_full_checkpoints(bf16_run: Path, tmp_path: Path) -> None:
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.checkpointing import latest_step
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path / "run"
    shutil.copytree(bf16_run, run, ignore=shutil.ignore_patterns(".lock"))
    train(run, build_config("quick_cpu", {**SMALL, "steps": 3, "keep_checkpoints": 2}))
    ckpts = run / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]
    assert (ckpts / "latest").read_text().strip() == "step_3" and latest_step(RunDir(run, create=False)) == 3


def test_eval_scores_the_full_checkpoint_weights(bf16_run: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from qerl_cli.eval.harness import run_eval
    from qerl_cli.manifest import sha256_file
    from qerl_cli.models import load_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path / "run"
    shutil.copytree(bf16_run, run, ignore=shutil.ignore_patterns(".lock"))
    train(run, build_config("quick_cpu", {**SMALL, "steps": 1}))
    ckpt = run / "train" / "checkpoints" / "step_1"
    trained = load_file(str(ckpt / "weights.safetensors"))

    result = run_eval(run, "arith:1", limit=1, max_tokens=2, device="cpu")  # --checkpoint latest
    assert result["checkpoint"]["name"] == "step_1" and result["checkpoint"]["adapter"] is None
    assert result["checkpoint"]["weights"]["sha256"] == sha256_file(ckpt / "weights.safetensors")

    from qerl_cli.train.checkpointing import load_weights  # what run_eval applied, checked tensor by tensor

    model = load_model(str(run / "model"), dtype=torch.float32)[0]
    params = dict(model.named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(params[name], trained[name])  # one lr=1e-3 step moved it
    embed = params["model.embed_tokens.weight"].detach().clone()
    load_weights(model, ckpt)
    for n, t in trained.items():
        assert torch.equal(params[n], t), n
    assert torch.equal(params["model.embed_tokens.weight"], embed)  # frozen: not in the file, left as is

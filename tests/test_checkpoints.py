"""The one checkpoint module (qerl_cli/train/checkpointing.py): every kind is written and read back through it,
pruning keeps N of each kind, and resume finds each kind's last step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, sha256_file
from qerl_cli.train import checkpointing as ck


def _tiny(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _lora(seed: int = 0, perturb: int | None = None) -> torch.nn.Module:
    from qerl_cli.lora import attach_lora, make_lora_config

    model = attach_lora(_tiny(), make_lora_config(rank=4), seed=seed)
    if perturb is not None:  # lora_B starts at zero: make the adapter change the outputs
        g = torch.Generator().manual_seed(perturb)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data = torch.randn(p.shape, generator=g) * 0.1
    return model


def _lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


IDS = torch.tensor([[1, 5, 9, 17, 33]])


def test_adapter_kind_round_trips_with_its_state_and_flashrl_scales(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    model = _lora(perturb=3)
    scales = {"model.layers.0.mlp.down_proj": torch.tensor([0.25, 0.5])}
    state = {"optimizer": {"lr": 0.1}, ck.ROLLOUT_QUANT_KEY: {"fixed_scales": True, "scales": scales}}
    path = ck.save_checkpoint(run, 3, model, state, {"algo": "grpo"}, keep=2)

    assert path == ck.checkpoint_path(run, 3) and path.name == "step_3"
    assert ck.checkpoint_kind(path) == ck.ADAPTER
    # the on-disk layout: peft's adapter dir, the trainer state as safetensors + JSON (no pickle), config.json,
    # the record hashing every file, `latest`
    assert (path / "adapter" / "adapter_model.safetensors").is_file() and not (path / "trainer_state.pt").exists()
    assert (path / "trainer_state.safetensors").is_file() and (path / "trainer_state.json").is_file()
    assert (path / "config.json").is_file() and (path.parent / "latest").read_text() == "step_3\n"
    record = ck.read_record(path)
    assert record["step"] == 3 and record["kind"] == ck.ADAPTER
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "trainer_state.safetensors",
            "trainer_state.json", "config.json"} <= set(record["files"])
    for rel, f in record["files"].items():
        assert f == {"sha256": sha256_file(path / rel), "bytes": (path / rel).stat().st_size}, rel
    assert ck.verify_checkpoint(run, path) == record
    loaded = ck.load_checkpoint(path)
    assert loaded["step"] == 3 and loaded["optimizer"] == {"lr": 0.1} and "rng" in loaded
    rq = ck.rollout_quant_state(loaded)
    assert rq["fixed_scales"] is True and torch.equal(rq["scales"]["model.layers.0.mlp.down_proj"],
                                                      torch.tensor([0.25, 0.5]))
    assert ck.rollout_quant_state({"optimizer": {}}) is None  # a checkpoint without FlashRL
    assert ck.weights_record(path) == {"adapter_sha256": sha256_file(path / "adapter" / "adapter_model.safetensors")}

    # resume: into a live adapter that started elsewhere, exactly
    fresh = _lora(perturb=9)
    want = _lora_tensors(model)
    assert any(not torch.equal(p, want[n]) for n, p in _lora_tensors(fresh).items())
    ck.load_adapter_weights(fresh, path)
    got = _lora_tensors(fresh)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    # eval: onto a freshly loaded base, the same outputs as the trained model
    evaluated, adapter_info, weights_info = ck.apply_to_model(run, _tiny(), path)
    assert weights_info is None and adapter_info["path"] == "train/checkpoints/step_3/adapter"
    with torch.no_grad():
        torch.testing.assert_close(evaluated(IDS).logits, model(IDS).logits, rtol=0, atol=0)
        assert not torch.allclose(_tiny()(IDS).logits, model(IDS).logits)  # the adapter matters


def test_full_kind_round_trips_for_resume_and_eval(tmp_path: Path) -> None:
    from qerl_cli.train.full_finetune import FullFinetune

    run = RunDir(tmp_path / "r")
    model = _tiny()
    full = FullFinetune(model)
    with torch.no_grad():
        for m in full.masters.values():
            m.add_(0.01)
    full.sync_()
    path = ck.save_checkpoint(run, 5, model, {"optimizer": {}}, {}, keep=1, full_weights=full.weights())
    assert ck.checkpoint_kind(path) == ck.FULL and (path / "weights.safetensors").is_file()
    assert not (path / "adapter").exists() and ck.load_checkpoint(path)["step"] == 5
    assert ck.weights_record(path) == {"weights_sha256": sha256_file(path / "weights.safetensors")}
    saved = ck.read_full_weights(path, set(full.masters))
    assert "model.embed_tokens.weight" not in saved  # frozen: not a trained weight
    assert all(torch.equal(saved[n], full.masters[n]) for n in full.masters)
    with pytest.raises(QerlError, match="other parameters"):
        ck.read_full_weights(path, set(full.masters) - {"model.norm.weight"})

    resumed = FullFinetune(_tiny())
    resumed.load(path)
    assert all(torch.equal(resumed.masters[n], full.masters[n]) for n in full.masters)
    evaluated, adapter_info, weights_info = ck.apply_to_model(run, _tiny(), path)
    assert adapter_info is None and weights_info == {"path": "train/checkpoints/step_5/weights.safetensors",
                                                     "sha256": sha256_file(path / "weights.safetensors")}
    with torch.no_grad():
        torch.testing.assert_close(evaluated(IDS).logits, model(IDS).logits, rtol=0, atol=0)


def test_pruning_keeps_n_of_each_kind(tmp_path: Path) -> None:
    from qerl_cli.train.full_finetune import FullFinetune

    run = RunDir(tmp_path / "r")
    lora = _lora(perturb=1)
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(run, step, lora, {}, {}, keep=2)
    assert list(ck.list_checkpoints(run)) == [3, 4]  # keep=2 while training

    mixed = RunDir(tmp_path / "mixed")  # e.g. a run dir whose old full checkpoints sit next to adapter ones
    full = FullFinetune(_tiny())
    for step in (1, 2, 3):
        ck.save_checkpoint(mixed, step, None, {}, {}, keep=0, full_weights=full.weights())
    for step in (4, 5, 6):
        ck.save_checkpoint(mixed, step, lora, {}, {}, keep=0)
    (ck.checkpoints_dir(mixed) / "step_9").mkdir()  # an incomplete directory is no checkpoint: never counted
    assert list(ck.list_checkpoints(mixed)) == [1, 2, 3, 4, 5, 6]
    assert list(ck.list_checkpoints(mixed, ck.FULL)) == [1, 2, 3]
    removed = ck.prune_checkpoints(mixed, 2)
    assert sorted(p.name for p in removed) == ["step_1", "step_4"]
    assert list(ck.list_checkpoints(mixed, ck.FULL)) == [2, 3]
    assert list(ck.list_checkpoints(mixed, ck.ADAPTER)) == [5, 6]
    assert ck.prune_checkpoints(mixed, 0) == [] and len(ck.list_checkpoints(mixed)) == 4  # 0: keep all


def test_resume_finds_each_kinds_last_step(tmp_path: Path) -> None:
    from qerl_cli.train.full_finetune import FullFinetune

    full, lora = FullFinetune(_tiny()), _lora()
    runs = {ck.FULL: RunDir(tmp_path / "full"), ck.ADAPTER: RunDir(tmp_path / "lora")}
    for step in (2, 4, 6):
        ck.save_checkpoint(runs[ck.FULL], step, None, {}, {}, keep=0, full_weights=full.weights())
        ck.save_checkpoint(runs[ck.ADAPTER], step, lora, {}, {}, keep=0)
    for kind, run in runs.items():
        assert ck.latest_step(run) == 6
        last = ck.resolve_checkpoint(run, "latest")
        assert last is not None and ck.checkpoint_kind(last) == kind and ck.checkpoint_step(last) == 6
        assert ck.resolve_checkpoint(run, "step_4") == ck.checkpoint_path(run, 4)
        assert ck.resolve_checkpoint(run, "base") is None
        # a crash after the rename but before `latest` moved: `latest` still names the previous one
        ck.write_latest(run, 4)
        assert ck.latest_step(run) == 4
        # `latest` naming a checkpoint that is gone (pruned by hand): the newest complete one
        ck.write_latest(run, 8)
        assert ck.latest_step(run) == 6
        with pytest.raises(QerlError, match=r"does not exist .*have: step_2, step_4, step_6"):
            ck.resolve_checkpoint(run, "step_3")
    empty = RunDir(tmp_path / "empty")
    assert ck.latest_step(empty) is None
    with pytest.raises(QerlError, match="has no training checkpoint"):
        ck.resolve_checkpoint(empty, "latest")
    with pytest.raises(QerlError, match="latest, base or step_N"):
        ck.resolve_checkpoint(empty, "final")

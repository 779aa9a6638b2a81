"""scripts/upcycle_moe.py: a dense Llama as a Mixtral whose experts are copies of its MLP. With identical experts and
Mixtral's renormalised top-k weights the upcycled model computes the dense model's function (the embedded
SmolLM2-135M in fp32 here, to rounding); the checkpoint it writes is one `qerl quantize` takes, and its routing varies
from token to token. docs/moe.md, "The upcycled model"."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from tests.helpers import qerl_exit_code

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread

ROOT = Path(__file__).resolve().parents[1]


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("upcycle_moe", ROOT / "scripts" / "upcycle_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_upcycled_embedded_model_computes_the_dense_models_logits(embedded) -> None:
    from qerl_cli.moe import route

    dense, tok = embedded
    moe = _script().upcycle(dense, experts=4, top_k=2, seed=0)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 4
    ids = torch.tensor([tok("What is 12 + 7? Answer with a number.")["input_ids"]])
    with torch.no_grad():
        want, got = dense(ids).logits, moe(ids).logits
        # the top-2 of 4 experts vary by token (a random router), yet the weighted sum of identical experts is the
        # MLP's output: fp32 rounding only (logits are O(30))
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
        h = moe.model.embed_tokens(ids)[0]
        index = route(moe.model.layers[0].post_attention_layernorm(h), moe.model.layers[0].mlp.gate.weight, 2, True)[2]
    assert len({tuple(sorted(r)) for r in index.tolist()}) > 1
    block = moe.model.layers[0].mlp.experts
    assert torch.equal(block.gate_up_proj[0], block.gate_up_proj[3]) and torch.equal(block.down_proj[1],
                                                                                    dense.model.layers[0].mlp.down_proj.weight)


def test_noise_makes_the_experts_distinct(tiny_source) -> None:
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(tiny_source), dtype=torch.float32).eval()
    moe = _script().upcycle(dense, experts=3, top_k=2, noise=1e-3, seed=1)
    e = moe.model.layers[1].mlp.experts
    assert not torch.equal(e.gate_up_proj[0], e.gate_up_proj[1])
    rel = (e.down_proj[2] - dense.model.layers[1].mlp.down_proj.weight).norm() / e.down_proj[2].norm()
    assert 1e-4 < float(rel.detach()) < 1e-2
    ids = torch.tensor([[1, 57, 913, 100]])
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=1e-2)
    with pytest.raises(QerlError, match="top-k"):
        _script().upcycle(dense, experts=2, top_k=3)


def test_the_written_checkpoint_is_one_qerl_quantize_takes(tiny_source, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.models import load_model

    out, run = tmp_path / "moe", tmp_path / "run"
    record = _script().main(["--out", str(out), "--model", str(tiny_source), "--experts", "4", "--top-k", "2"])
    assert record["experts"] == 4 and json.loads((out / "upcycle.json").read_text())["top_k"] == 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4 and cfg["sliding_window"] is None
    assert (out / "tokenizer.json").is_file()
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_source), dtype=torch.float32).eval()
    moe = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 57, 913, 100, 2000, 31]])
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)

    assert qerl_exit_code("quantize", "--run", str(run), str(out), "--format", "nvfp4", "--show-layers", "0") == 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["quantize"]["status"] == "completed"
    qmodel, _ = load_model(str(run / "model"), dtype=torch.float32)
    assert type(qmodel.model.layers[0].mlp).__name__ == "MoeBlock"
    with torch.no_grad():  # NVFP4 experts and attention: close to the dense model, not equal
        err = (qmodel(ids).logits - dense(ids).logits).abs().max() / dense(ids).logits.abs().max()
    assert float(err) < 0.2

"""Mixtral (qerl_cli/arch/mixtral.py) on a tiny random MixtralConfig built here (2 layers, 8 experts, top-2,
hidden 64; SmolLM2's tokenizer): its checkpoint under Mixtral's own names (which transformers reads back), the
builtin engine's greedy tokens against transformers' own Mixtral, LoRA on attention and experts, the routing
recorded and replayed as for Qwen3-MoE (tests/test_routing_replay.py), and the refusals. docs/moe.md, "Mixtral"."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from qerl_cli.arch import spec_for
from qerl_cli.errors import QerlError
from qerl_cli.moe import MoeBlock, moe_blocks, router_metrics
from tests.test_routing_replay import PROMPTS, by_hand, hand_disagreement, own_topk, perturbed, restore

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread

IDS = torch.tensor([[1, 57, 913, 100, 2000, 31, 8, 415]])


def tiny_mixtral_config(tok, **kw):  # noqa: ANN001, ANN201
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **kw)


@pytest.fixture(scope="module")
def source(tiny_source):
    """The tiny random Mixtral, its weights rounded to bf16 (so the bf16 checkpoint holds them exactly), in fp32."""
    from transformers import AutoTokenizer, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tiny_source))
    torch.manual_seed(0)
    model = MixtralForCausalLM(tiny_mixtral_config(tok)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, tok


@pytest.fixture(scope="module")
def runs(source, tmp_path_factory):
    from qerl_cli.quantize import quantize_model

    out = {}
    for fmt in ("bf16", "nvfp4"):
        out[fmt] = tmp_path_factory.mktemp(f"mixtral_{fmt}")
        quantize_model(out[fmt], None, fmt=fmt, loaded=source)
    return out


def test_the_spec_maps_the_checkpoints_names_and_leaves_qwen3_moes() -> None:
    mixtral, qwen = spec_for("mixtral"), spec_for("qwen3_moe")
    for memory, disk in (("model.layers.3.mlp.experts.2.gate_proj.weight_packed",
                          "model.layers.3.block_sparse_moe.experts.2.w1.weight_packed"),
                         ("model.layers.3.mlp.experts.7.up_proj", "model.layers.3.block_sparse_moe.experts.7.w3"),
                         ("model.layers.0.mlp.experts.0.down_proj.weight",
                          "model.layers.0.block_sparse_moe.experts.0.w2.weight"),
                         ("model.layers.1.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight"),
                         ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
                         ("lm_head", "lm_head")):
        assert mixtral.disk_name(memory) == disk and mixtral.memory_name(disk) == memory
        assert qwen.disk_name(memory) == memory
    cfg = tiny_mixtral_config(type("Tok", (), {"__len__": lambda self: 300, "bos_token_id": 1, "eos_token_id": 2})())
    dims = mixtral.dims(cfg)
    assert (dims.experts, dims.top_k, dims.intermediate, dims.qk_norm) == (8, 2, 32, False)
    assert mixtral.moe.norm_topk(cfg) and not mixtral.sliding_window(cfg)


def test_the_checkpoint_has_mixtrals_names_and_transformers_reads_it(source, runs) -> None:
    from transformers import AutoModelForCausalLM

    model, _ = source
    for fmt, main in (("bf16", "weight"), ("nvfp4", "weight_packed")):
        model_dir = runs[fmt] / "model"
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        p = "model.layers.1.block_sparse_moe"
        assert {f"{p}.experts.5.{w}.{main}" for w in ("w1", "w2", "w3")} | {f"{p}.gate.weight"} <= keys
        assert not any(".mlp." in k for k in keys)
        if fmt == "nvfp4":
            qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
            assert {"model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"} <= set(qc["ignore"])
    # transformers' own loader fuses the bf16 checkpoint's experts back: the source's function
    hf = AutoModelForCausalLM.from_pretrained(str(runs["bf16"] / "model"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_builtin_engine_decodes_as_transformers(source, runs, fmt: str) -> None:
    from qerl_cli.models import load_model
    from qerl_cli.rollout import BuiltinEngine, SamplingParams

    model, tok = source
    qmodel, _ = load_model(str(runs[fmt] / "model"), dtype=torch.float32)
    assert all(isinstance(layer.mlp, MoeBlock) and layer.mlp.norm_topk_prob for layer in qmodel.model.layers)
    # bf16 weights are the source's own: transformers' Mixtral decodes the reference; nvfp4: qerl's model does
    reference = model if fmt == "bf16" else qmodel
    engine = BuiltinEngine(qmodel, tok, max_batch_slots=3, max_model_len=64, dtype=torch.float32)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]))
    for ids, sample in zip(PROMPTS, out.samples, strict=True):
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert sample.token_ids == want[0, len(ids):].tolist()
        assert sample.routing.shape == (len(ids) + 7, 2, 2)


@pytest.fixture(scope="module")
def rollout(runs):
    """The nvfp4 model (fp32 compute) with LoRA on attention and experts, and the engine's samples with routing."""
    from qerl_cli.models import load_model
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.train.batch import build_batch
    from tests.test_moe import with_lora

    model, tok = load_model(str(runs["nvfp4"] / "model"), dtype=torch.float32)
    model = with_lora(model, seed=2)
    engine = BuiltinEngine(model, tok, max_batch_slots=4, max_model_len=64, dtype=torch.float32)
    samples = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=7, stop_token_ids=[],
                                                      seed=5)).samples
    batch = build_batch([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [False] * len(samples), pad_id=0,
                        routings=[s.routing for s in samples])
    return model, samples, batch


def test_lora_attaches_to_attention_and_experts_and_trains(rollout) -> None:
    model, _, batch = rollout
    p = spec_for("mixtral").projections
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert set(p.qkv) | {p.o} <= adapted
    experts = {getattr(m, "parameter_name", None) for _, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {"gate_up_proj", "down_proj"} <= experts
    model.train()
    try:
        loss = model(batch.input_ids, attention_mask=batch.attention_mask, labels=batch.input_ids).loss
        loss.backward()
    finally:
        model.eval()
    grads = {n: q.grad for n, q in model.named_parameters() if "lora_B" in n}
    assert any("experts" in n for n in grads) and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    model.zero_grad(set_to_none=True)


def test_routing_is_recorded_and_replayed(rollout) -> None:
    model, samples, batch = rollout
    # recorded: the training forward's own top-k is the engine's, token for token (fp32, one device)
    router_metrics(model)
    seen, _ = own_topk(model, batch, replay=False)
    rec = batch.routing.reshape(-1, 2, 2).long()
    valid = (rec >= 0).all(-1)
    for j, own in enumerate(seen):
        assert torch.equal(own[valid[:, j]].sort(-1).values, rec[valid[:, j], j].sort(-1).values)
    assert router_metrics(model)["router/replay_disagreement"] == 0.0
    # replayed: with the routers moved after the rollout, the forward takes the recorded experts regardless
    full = batch.routing.clone()
    missing = (full < 0).all(-1, keepdim=True).expand_as(full)
    full[missing] = 0
    full[missing & (torch.arange(2).view(1, 1, 1, 2) == 1).expand_as(full)] = 1
    batch_full = type(batch)(**{**batch.__dict__, "routing": full})
    saved = perturbed(model)
    try:
        seen, logp = own_topk(model, batch_full, replay=True)
        metric = router_metrics(model)["router/replay_disagreement"]
        originals = by_hand(model, full)
        try:
            from qerl_cli.train.logprobs import sampled_logprobs

            with torch.no_grad():
                want = sampled_logprobs(model, batch_full, 1.0, chunk_tokens=512, packed=False)[0]
        finally:
            for b, f in originals:
                b.forward = f
    finally:
        restore(saved)
    assert 0.0 < metric < 1.0 and metric == pytest.approx(hand_disagreement(seen, full), abs=1e-12)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-6)
    assert len(moe_blocks(model)) == 2


def test_the_refusals(source) -> None:
    from transformers import MixtralForCausalLM

    from qerl_cli.moe import check_moe_config
    from qerl_cli.rollout import BuiltinEngine

    _, tok = source
    torch.manual_seed(0)
    windowed = MixtralForCausalLM(tiny_mixtral_config(tok, sliding_window=16)).eval()
    with pytest.raises(QerlError, match="sliding-window"):
        BuiltinEngine(windowed, tok, max_batch_slots=1, max_model_len=32)
    with pytest.raises(QerlError, match="router_jitter_noise"):
        check_moe_config(tiny_mixtral_config(tok, router_jitter_noise=0.01))

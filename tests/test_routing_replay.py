"""Routing replay for mixture-of-experts RL (docs/moe.md) on a tiny random Qwen3-MoE (2 sparse layers, 8 experts,
top-2, fp32): the builtin engine records every token's top-k per layer, the training forward routes with it under
``replay_routing`` (the router's own probabilities at the recorded experts, so it still gets a gradient), padded and
packed layouts line up, ``router/replay_disagreement`` counts what differs, and a trainer run logs it."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.moe import moe_blocks, replay_routing, route, router_metrics
from tests.test_moe import tiny_config, with_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread

PROMPTS = [[1, 57, 913, 100, 2000, 31], [7, 8, 9], [400, 401, 402, 403, 404, 405, 406, 407, 408]]


@pytest.fixture(scope="module")
def moe_run(tiny_source, tmp_path_factory):
    """A run directory of the tiny Qwen3-MoE with plain (bf16-format) weights."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from qerl_cli.quantize import quantize_model

    tok = AutoTokenizer.from_pretrained(str(tiny_source))
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("moe_replay")
    quantize_model(run, None, fmt="bf16", loaded=(Qwen3MoeForCausalLM(tiny_config(tok)).eval(), tok))
    return run


@pytest.fixture(scope="module")
def rollout(moe_run):
    """The fp32 model with LoRA on attention and experts, and a batch of the builtin engine's samples with their
    recorded routing."""
    from qerl_cli.models import load_model
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.train.batch import build_batch

    model, tok = load_model(str(moe_run / "model"), dtype=torch.float32)
    model = with_lora(model, seed=2)
    engine = BuiltinEngine(model, tok, max_batch_slots=4, max_model_len=64, dtype=torch.float32)
    res = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=7, stop_token_ids=[], seed=5))
    samples = res.samples
    batch = build_batch([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [False] * len(samples), pad_id=0,
                        routings=[s.routing for s in samples])
    return model, samples, batch


def own_topk(model, batch, replay: bool, packed: bool = False):  # noqa: ANN001, ANN201
    """A training forward (train mode, gradients on) of ``batch`` under replay (or measuring only); per sparse layer
    the top-k its own router picks [T, k] (forward pre-hooks see the block's input), and the log-probs."""
    from qerl_cli.train.logprobs import sampled_logprobs
    from qerl_cli.train.replay import replaying

    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(
        route(a[0].reshape(-1, a[0].shape[-1]).detach(), m.gate.weight, m.top_k, m.norm_topk_prob)[2]))
        for b in moe_blocks(model)]
    model.train()
    try:
        with replaying(model, batch, chunk_tokens=512, packed=packed, replay=replay):
            logp, _ = sampled_logprobs(model, batch, 1.0, chunk_tokens=512, packed=packed)
    finally:
        for h in hooks:
            h.remove()
        model.eval()
    return seen, logp


def hand_disagreement(seen: list[torch.Tensor], recorded: torch.Tensor) -> float:
    """The share of (token, layer) top-k sets that differ, counted over the tokens the rollout routed."""
    rec = recorded.reshape(-1, *recorded.shape[-2:]).long()
    valid = (rec >= 0).all(-1)  # [T, layers]
    differ = total = 0
    for j, own in enumerate(seen):
        ok = valid[:, j]
        same = (own.sort(-1).values == rec[:, j].sort(-1).values).all(-1)
        differ += int((~same & ok).sum())
        total += int(ok.sum())
    return differ / total


def test_the_engine_records_the_training_forwards_own_routing(rollout) -> None:
    model, samples, batch = rollout
    for s in samples:  # every token the model ran: the prompt's from the prefill, the completion's from decode
        assert s.routing.dtype == torch.uint8
        assert s.routing.shape == (len(s.prompt_token_ids) + len(s.token_ids) - 1, 2, 2)
    assert batch.routing.shape == (*batch.input_ids.shape, 2, 2) and batch.routing.dtype == torch.int16
    router_metrics(model)
    seen, _ = own_topk(model, batch, replay=False)
    rec = batch.routing.reshape(-1, 2, 2).long()
    valid = (rec >= 0).all(-1)
    assert int(valid[:, 0].sum()) == sum(len(s.prompt_token_ids) + len(s.token_ids) - 1 for s in samples)
    for j, own in enumerate(seen):  # the same experts, token for token
        assert torch.equal(own[valid[:, j]].sort(-1).values, rec[valid[:, j], j].sort(-1).values)
    assert router_metrics(model)["router/replay_disagreement"] == 0.0


def test_the_per_module_path_records_what_the_fast_path_records(rollout) -> None:
    # fast_lora off: the engine calls the MoeBlock itself (its on_route hook) instead of the decode plan's MoePlan
    from qerl_cli.rollout import BuiltinEngine, SamplingParams

    model, _, _ = rollout
    params = SamplingParams(n=1, temperature=0.0, max_tokens=6, stop_token_ids=[])
    got = [BuiltinEngine(model, None, max_batch_slots=2, max_model_len=64, dtype=torch.float32,
                         fast_lora=fast).generate(PROMPTS, params).samples for fast in (True, False)]
    assert [s.token_ids for s in got[0]] == [s.token_ids for s in got[1]]
    for a, b in zip(*got, strict=True):
        assert a.routing.shape[0] == len(a.prompt_token_ids) + 5 and torch.equal(a.routing, b.routing)
    off = BuiltinEngine(model, None, max_batch_slots=2, max_model_len=64, dtype=torch.float32, record_routing=False)
    assert all(s.routing is None for s in off.generate(PROMPTS, params).samples)


def perturbed(model):  # noqa: ANN001, ANN201
    """The routers moved after the rollout (as an update would), kept trainable so their gradient shows."""
    g = torch.Generator().manual_seed(7)
    saved = []
    for b in moe_blocks(model):
        w = b.gate.weight
        saved.append((w, w.detach().clone(), w.requires_grad))
        with torch.no_grad():
            w.add_(torch.randn(w.shape, generator=g) * 0.5 * w.abs().mean())
        w.requires_grad_(True)
        w.grad = None
    return saved


def restore(saved) -> None:  # noqa: ANN001
    with torch.no_grad():
        for w, old, req in saved:
            w.copy_(old)
            w.requires_grad_(req)
            w.grad = None


def by_hand(model, recorded: torch.Tensor):  # noqa: ANN001, ANN201
    """Each block computing with ``recorded`` written out here: the router's softmax at those experts, renormalised."""
    rec = recorded.reshape(-1, *recorded.shape[-2:]).long()
    originals = []
    for j, b in enumerate(moe_blocks(model)):
        def forward(h, on_route=None, b=b, j=j):  # noqa: ANN001, ANN202
            x = h.reshape(-1, h.shape[-1])
            idx = rec[:, j]
            probs = torch.softmax(torch.nn.functional.linear(x, b.gate.weight), -1, dtype=torch.float32)
            w = probs.gather(-1, idx)
            w = w / w.sum(-1, keepdim=True)
            return b.experts(x, idx, w.to(x.dtype)).reshape(h.shape)
        originals.append((b, b.forward))
        b.forward = forward
    return originals


@pytest.mark.parametrize("packed", [False, True])
def test_replay_uses_the_recorded_experts_counts_disagreement_and_keeps_the_router_gradient(rollout,
                                                                                          packed: bool) -> None:
    from qerl_cli.train.logprobs import sampled_logprobs
    from qerl_cli.train.packing import packed_rows

    model, _, batch = rollout
    # the hand-made reference needs every token routed: the last token of each row (never run by the engine) and
    # the padding take the replayed forward's own top-k, so give them one, the same in both forwards
    full = batch.routing.clone()
    missing = (full < 0).all(-1, keepdim=True).expand_as(full)
    full[missing] = 0
    full[missing & (torch.arange(2).view(1, 1, 1, 2) == 1).expand_as(full)] = 1
    batch_full = type(batch)(**{**batch.__dict__, "routing": full})
    saved = perturbed(model)
    try:
        router_metrics(model)
        seen, logp = own_topk(model, batch_full, replay=True, packed=packed)
        metric = router_metrics(model)["router/replay_disagreement"]
        logp.sum().backward()
        grads = [b.gate.weight.grad.clone() for b in moe_blocks(model)]
        for b in moe_blocks(model):
            b.gate.weight.grad = None
        layout = packed_rows(full, batch.attention_mask) if packed else full
        originals = by_hand(model, layout)
        try:
            model.train()
            want = sampled_logprobs(model, batch_full, 1.0, chunk_tokens=512, packed=packed)[0]
            want.sum().backward()
        finally:
            model.eval()
            for b, f in originals:
                b.forward = f
        want_grads = [b.gate.weight.grad.clone() for b in moe_blocks(model)]
    finally:
        restore(saved)
    # the perturbed routers pick other experts for some tokens; replay took the recorded ones regardless
    assert 0.0 < metric < 1.0
    assert metric == pytest.approx(hand_disagreement(seen, layout), abs=1e-12)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):  # the router's gradient flows through the replayed weights
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_padded_and_packed_replay_agree(rollout) -> None:
    model, _, batch = rollout
    saved = perturbed(model)
    try:
        out = {}
        for packed in (False, True):
            router_metrics(model)
            _, logp = own_topk(model, batch, replay=True, packed=packed)
            out[packed] = (logp.detach(), router_metrics(model)["router/replay_disagreement"])
    finally:
        restore(saved)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    assert out[True][1] == out[False][1] > 0


def test_replay_off_routes_anew_and_a_mislaid_routing_is_refused(rollout) -> None:
    model, _, batch = rollout
    saved = perturbed(model)
    try:
        _, on = own_topk(model, batch, replay=True)
        _, off = own_topk(model, batch, replay=False)
        with torch.no_grad():
            free = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            with replay_routing(model, batch.routing, replay=False):
                measured = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        with pytest.raises(QerlError, match="laid out like the forward's input_ids"):
            with replay_routing(model, batch.routing[:, 1:]), torch.no_grad():
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        restore(saved)
    assert torch.equal(free, measured)  # measuring only changes nothing
    assert (on - off).abs().max() > 1e-4  # the perturbed routers' own choices give other log-probs
    assert all(b.replay is None for b in moe_blocks(model))


def test_config_switch_defaults_and_vllm() -> None:
    from qerl_cli.train.config import TrainConfig, train_flags

    assert TrainConfig().resolved().routing_replay is True
    assert TrainConfig(rollout_engine="vllm").resolved().routing_replay is False
    TrainConfig(rollout_engine="vllm", routing_replay=False).validate()
    with pytest.raises(QerlError, match="--routing-replay needs"):
        TrainConfig(rollout_engine="vllm", routing_replay=True).validate()
    assert any(f.decl == "--routing-replay/--no-routing-replay" for f in train_flags())


def test_a_training_step_with_replay_logs_the_disagreement(moe_run, tmp_path) -> None:
    import shutil

    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    (tmp_path / "r.py").write_text("def reward(prompts, completions, answer=None, **kw):\n"
                                   "    return [(sum(map(ord, c or '')) % 7) / 6 for c in completions]\n")
    over = {"steps": 1, "batch_prompts": 2, "num_generations": 2, "max_completion_length": 4, "shots": 0,
            "lora_rank": 4, "micro_batch_size": 4, "seed": 3, "reward": f"{tmp_path / 'r.py'}:reward"}
    run = shutil.copytree(moe_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    train(run, build_config("quick_cpu", over))
    (m,) = [json.loads(line) for line in (run / "train/metrics.jsonl").read_text().splitlines()]
    assert m["grad_norm"] > 0 and 0.0 <= m["router/replay_disagreement"] < 0.5
    manifest = json.loads((run / "manifest.json").read_text())
    assert '"routing_replay": true' in json.dumps(manifest)


class _Turns:
    """Episodes of 3 turns of 3 tokens, each followed by an observation of fixed token ids (no tokenizer needed)."""

    stop: tuple[str, ...] = ()
    max_turns = 3
    turn_tokens = 3
    workers = 2

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        return True

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str):  # noqa: ANN201
        from qerl_cli.rollout.episode import StepResult

        return StepResult(observation_ids=[11 + turn, 12 + prompt_index, 13 + sample_index])


def test_episode_routing_follows_parked_and_resumed_sequences(rollout) -> None:
    # observations are prefilled by extend() into slots the sequence did not start in (3 slots, 4 episodes); the
    # recorded routing of the whole episode is still the training forward's own
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.train.batch import build_batch

    model, _, _ = rollout
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64, dtype=torch.float32)
    res = engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=30, stop_token_ids=[],
                                                      seed=1), episodes=_Turns())
    samples = res.samples
    assert all(len(s.observation_spans) == 2 for s in samples) and res.stats["resumes"] > 0
    for s in samples:
        assert s.routing.shape[0] == len(s.prompt_token_ids) + len(s.token_ids) - 1
    batch = build_batch([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [False] * len(samples), pad_id=0,
                        model_masks=[s.model_mask() for s in samples], routings=[s.routing for s in samples])
    router_metrics(model)
    seen, _ = own_topk(model, batch, replay=False)
    assert hand_disagreement(seen, batch.routing) == 0.0
    assert router_metrics(model)["router/replay_disagreement"] == 0.0


def test_memory_plan_counts_the_recorded_routing_per_slot(moe_run) -> None:  # noqa: ANN001
    """The plan's bytes per cached token are the engine's: K and V plus the recorded top-k ids (uint8 here)."""
    from qerl_cli.models import load_model
    from qerl_cli.rollout import BuiltinEngine
    from qerl_cli.train.model_dims import ModelDims

    model, tok = load_model(str(moe_run / "model"), dtype=torch.float32)
    engine = BuiltinEngine(model, tok, max_batch_slots=2, max_model_len=64, dtype=torch.float32)
    dims = ModelDims.from_config(model.config)
    routing = dims.layers * dims.top_k  # one byte per id: 8 experts
    assert dims.experts == 8 and engine.shape.routing is not None and engine.shape.routing.dtype == torch.uint8
    assert dims.kv_bytes_per_token(4) == 2 * dims.layers * dims.kv_heads * dims.head_dim * 4 + routing
    assert engine.shape.bytes_per_slot() == engine.shape.max_len * dims.kv_bytes_per_token(4)

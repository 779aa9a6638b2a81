"""An architecture qerl did not know, added through `qerl_cli.arch.register` alone (docs/DEVELOPING.md, "How to add
an architecture"): a Llama whose model_type is new and whose projections carry other names (Meta's original
wq/wk/wv/wo and w1/w3/w2), built from a tiny config here. Nothing outside this file and the spec it registers knows
it, yet it quantizes (the spec's fused groups share an NVFP4 global scale), loads back, takes a LoRA on its own names
from the default targets, and the builtin rollout engine decodes it exactly as transformers does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from qerl_cli.arch import ArchSpec, Projections, register, spec_for, unregister
from qerl_cli.errors import QerlError
from tests.helpers import tiny_llama

MODEL_TYPE = "qerl_tiny_test"
# Meta's names: w1 is the gate, w3 the up, w2 the down projection
NAMES = Projections(q="wq", k="wk", v="wv", o="wo", gate="w1", up="w3", down="w2")
LLAMA = spec_for("llama").projections
TINY = ArchSpec(MODEL_TYPE, "test", NAMES, gated_mlps=("TinyMLP",))


def _renamed(role_to_name: dict[str, str]) -> dict[str, property]:
    # transformers' forward calls the Llama names: each becomes a read-only alias of the module under its new name
    return {old: property(lambda self, new=new: self._modules[new]) for old, new in role_to_name.items()}


TinyAttention = type("TinyAttention", (LlamaAttention,), _renamed(
    {getattr(LLAMA, r): getattr(NAMES, r) for r in ("q", "k", "v", "o")}))
TinyMLP = type("TinyMLP", (LlamaMLP,), _renamed({getattr(LLAMA, r): getattr(NAMES, r) for r in ("gate", "up", "down")}))


class TinyConfig(LlamaConfig):
    model_type = MODEL_TYPE


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            for module, cls, roles in ((layer.self_attn, TinyAttention, "qkvo"),
                                       (layer.mlp, TinyMLP, ("gate", "up", "down"))):
                moved = [(getattr(NAMES, r), module._modules.pop(getattr(LLAMA, r))) for r in roles]
                module.__class__ = cls
                module._modules.update(moved)


AutoConfig.register(MODEL_TYPE, TinyConfig, exist_ok=True)
AutoModelForCausalLM.register(TinyConfig, TinyForCausalLM, exist_ok=True)


@pytest.fixture
def tiny() -> tuple[nn.Module, object]:
    """The tiny random Llama of tests/helpers.py, its weights in the new architecture (fp32, seeded)."""
    llama, tok = tiny_llama()
    config = TinyConfig(**{k: v for k, v in llama.config.to_dict().items() if k != "model_type"})
    model = TinyForCausalLM(config).eval()
    for p, q in zip(model.state_dict().values(), llama.state_dict().values(), strict=True):
        p.copy_(q)  # same order, renamed: the two compute the same function
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 2]])
        assert torch.equal(model(ids).logits, llama(ids).logits)
    return model, tok


@pytest.fixture
def registered() -> ArchSpec:
    register(TINY)
    yield TINY
    unregister(MODEL_TYPE)


def test_an_unknown_architecture_is_one_clear_error(tiny) -> None:
    from qerl_cli.rollout import BuiltinEngine

    model, tok = tiny
    with pytest.raises(QerlError, match=f"no architecture for model_type '{MODEL_TYPE}'.*How to add an architecture"):
        spec_for(model)
    with pytest.raises(QerlError, match="builtin rollout engine supports model types"):
        BuiltinEngine(model, tok, max_batch_slots=1, max_model_len=32)


def test_a_registered_architecture_quantizes_loads_trains_and_decodes(tiny, registered, tmp_path) -> None:
    from qerl_cli.lora import attach_lora, make_lora_config
    from qerl_cli.models import load_model
    from qerl_cli.quantize import quantize_model
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.train.model_dims import ModelDims

    model, tok = tiny
    assert spec_for(model) is registered
    dims = ModelDims.from_config(model.config)
    assert set(dims.linear_shapes()) == set(NAMES.names)

    result = quantize_model(tmp_path / "run", None, fmt="nvfp4", loaded=(model, tok))
    qmodel, _ = load_model(str(result.model_dir), dtype=torch.float32)
    attn = qmodel.model.layers[0].self_attn
    assert type(qmodel).__name__ == "TinyForCausalLM" and hasattr(attn, "wq") and "q_proj" not in attn._modules
    # q/k/v, fused by the spec, share one NVFP4 global scale; o has its own
    scales = [getattr(attn, n).weight_global_scale for n in NAMES.qkv]
    assert all(torch.equal(s, scales[0]) for s in scales)

    prompts = [tok("2 + 3 =")["input_ids"], tok("The sea is")["input_ids"]]
    engine = BuiltinEngine(qmodel, tok, max_batch_slots=2, max_model_len=64)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]))
    for ids, sample in zip(prompts, out.samples, strict=True):
        with torch.no_grad():
            want = qmodel.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert sample.token_ids == want[0, len(ids):].tolist()

    # the default LoRA targets are the built-in names; the architecture's own take the adapters
    peft_model = attach_lora(qmodel, make_lora_config(rank=2), seed=0)
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(NAMES.names)
    ids = torch.tensor([prompts[0]])
    loss = peft_model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads)

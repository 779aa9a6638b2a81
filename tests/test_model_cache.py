"""The dequantized GGUF cache (qerl_cli/models.py): a load from it is the GGUF load, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qerl_cli import models


def test_cached_load_equals_the_gguf_load(embedded) -> None:
    """The session's first load (the `embedded` fixture) converted the GGUF file and wrote the cache; a second load
    reads it: the same parameters, tokenizer and logits, in fp32 and as a bf16 cast."""
    model, tok = embedded
    src = models.resolve_model(None)
    folder = models.gguf_cache_dir(Path(src.location) / src.gguf_file)
    marker = json.loads((folder / "qerl_gguf_cache.json").read_text())
    assert marker == {"gguf": models.EMBEDDED_FILE, "dtype": "float32"}
    assert sorted(p.suffix for p in folder.iterdir() if p.suffix in (".pt", ".bin", ".pkl", ".pickle")) == []
    cached, ctok = models.load_model(None)
    a, b = model.state_dict(), cached.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = "<|im_start|>user\n12 + 7 = ?<|im_end|>\n"
    ids = tok(text).input_ids
    assert ctok(text).input_ids == ids and ctok.eos_token_id == tok.eos_token_id
    assert ctok.pad_token_id == tok.pad_token_id and ctok.chat_template == tok.chat_template
    with torch.no_grad():
        assert torch.equal(cached(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
    half, _ = models.load_model(None, dtype=torch.bfloat16)
    assert all(torch.equal(v.to(torch.bfloat16), half.state_dict()[k]) for k, v in a.items())


def test_a_folder_without_its_marker_is_not_a_cache(tmp_path, use_options) -> None:  # noqa: ANN001
    """A copy interrupted before its marker was written is never read (the marker is written last)."""
    src = models.resolve_model(None)
    use_options(cache_dir=tmp_path)
    folder = models.gguf_cache_dir(Path(src.location) / src.gguf_file)
    assert folder.is_relative_to(tmp_path / "gguf") and models.cached_gguf(src) is None
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert models.cached_gguf(src) is None
    (folder / "qerl_gguf_cache.json").write_text("{}")
    assert models.cached_gguf(src) == folder
    shutil.rmtree(folder)

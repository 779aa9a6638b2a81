"""What the CLI prints besides its tables: one line before a long GGUF conversion that shows no progress of its
own, and whole lines (not rich's 80-column wrap) where the output is a log file or a pipe."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from qerl_cli import cli
from qerl_cli.models import conversion_notice, resolve_model


def test_quantize_says_so_before_converting_a_gguf_file(tmp_path: Path, monkeypatch, capsys) -> None:
    import gguf
    import numpy as np

    odd = tmp_path / "odd.gguf"  # a readable GGUF of an architecture transformers cannot convert: fails fast
    writer = gguf.GGUFWriter(str(odd), "notanarch")
    writer.add_tensor("blk.0.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["qerl", "quantize", str(odd), "--run", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err
    notice = f"converting the GGUF model {odd} (first load of this file only) ..."
    assert exc.value.code == 2 and notice in err
    assert err.index(notice) < err.index(f"error: could not load model {odd}: GGUF model with architecture notanarch")


def test_the_embedded_model_is_announced_only_while_no_converted_copy_is_cached(embedded, tiny_source,
                                                                                tmp_path: Path, use_options) -> None:  # noqa: ANN001
    assert conversion_notice(resolve_model(None)) is None  # the session's cache holds the converted copy
    use_options(cache_dir=tmp_path)  # an empty cache: the next load converts
    assert conversion_notice(resolve_model(None)) == "converting the embedded GGUF model (first run only, ~40 s) ..."
    assert conversion_notice(resolve_model(str(tiny_source))) is None  # a model directory is read as it is


def test_lines_stay_whole_where_the_output_is_not_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    out = cli.make_console(file=buf)
    line = "step 3/8: " + " ".join(f"metric_{i}=0.{i:03d}" for i in range(12))  # 191 characters
    out.print(line, highlight=False)
    assert out.width == cli.LOG_WIDTH and buf.getvalue() == line + "\n"
    monkeypatch.setenv("COLUMNS", "100")  # a width the user asked for wins
    assert cli.make_console(file=io.StringIO()).width == 100

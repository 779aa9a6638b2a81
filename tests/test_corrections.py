"""Mismatch metrics and importance weights against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.corrections import is_weights, mismatch_metrics

# Probabilities of the sampled tokens. rho = pi/mu: row 0 [2, 0.5, 1], row 1 [3, 1.2, pad].
# The padding slot has wildly different probabilities (0.01 vs 0.99): it must never count.
PI = [[0.5, 0.2, 0.9], [0.3, 0.6, 0.01]]
MU = [[0.25, 0.4, 0.9], [0.1, 0.5, 0.99]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
TRAIN = torch.tensor([[math.log(p) for p in row] for row in PI], dtype=torch.float64)
ROLL = torch.tensor([[math.log(p) for p in row] for row in MU], dtype=torch.float64)
RHO = [2.0, 0.5, 1.0, 3.0, 1.2]  # valid tokens, row-major


def _w(kind: str, **kw: float) -> tuple[list[list[float]], dict[str, float]]:
    w, m = is_weights(kind, TRAIN, ROLL, MASK, **kw)
    assert not w.requires_grad
    return w.tolist(), m


def _rows(w: list[list[float]], expected: list[list[float]]) -> None:
    for row, exp_row in zip(w, expected, strict=True):
        assert row == pytest.approx(exp_row, abs=1e-12)


def test_mismatch_metrics():
    m = mismatch_metrics(TRAIN, ROLL, MASK)
    assert m["sampling/k1"] == pytest.approx(-sum(math.log(r) for r in RHO) / 5)
    assert m["sampling/k1"] == pytest.approx(-math.log(3.6) / 5)
    assert m["sampling/k3"] == pytest.approx(sum(r - math.log(r) - 1 for r in RHO) / 5)
    assert m["sampling/max_abs_dprob"] == pytest.approx(0.25)  # |0.25 - 0.5|; padding's 0.98 ignored
    # sequence log-ratios: row 0 log(2 * 0.5 * 1) = 0, row 1 log(3 * 1.2) = log 3.6
    assert m["sampling/seq_log_ratio_mean"] == pytest.approx(math.log(3.6) / 2)
    assert m["sampling/seq_log_ratio_min"] == pytest.approx(0.0, abs=1e-12)
    assert m["sampling/seq_log_ratio_max"] == pytest.approx(math.log(3.6))
    # lengths 3, 2: two points -> correlation -1, slope (0 - log 3.6) / (3 - 2)
    assert m["sampling/seq_log_ratio_len_corr"] == pytest.approx(-1.0)
    assert m["sampling/seq_log_ratio_len_slope"] == pytest.approx(-math.log(3.6))


def test_identical_policies_have_zero_mismatch():
    m = mismatch_metrics(TRAIN, TRAIN.clone(), MASK)
    assert m["sampling/k1"] == 0.0 and m["sampling/k3"] == 0.0 and m["sampling/max_abs_dprob"] == 0.0
    assert m["sampling/seq_log_ratio_len_corr"] == 0.0  # undefined (no spread) -> 0


def test_none():
    w, m = _w("none")
    _rows(w, [[1, 1, 1], [1, 1, 0]])
    assert m["sampling/is_weight_mean"] == 1.0 and m["sampling/is_truncated_frac"] == 0.0


def test_token_tis():
    w, m = _w("token_tis")  # C = 2 by default
    _rows(w, [[2.0, 0.5, 1.0], [2.0, 1.2, 0.0]])
    assert m["sampling/is_truncated_frac"] == pytest.approx(1 / 5)  # only rho=3 (rho=2 is not above C)
    assert m["sampling/is_weight_min"] == pytest.approx(0.5)
    assert m["sampling/is_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 2 + 1.2) / 5)
    assert m["sampling/is_weight_max"] == pytest.approx(2.0)
    assert m["sampling/is_masked_frac"] == 0.0


def test_token_mis():
    w, m = _w("token_mis")  # C = 10, lo = 1/10: nothing masked
    _rows(w, [[2.0, 0.5, 1.0], [3.0, 1.2, 0.0]])
    assert m["sampling/is_masked_frac"] == 0.0
    w, m = _w("token_mis", cap=2.5, lo=0.6)
    _rows(w, [[2.0, 0.0, 1.0], [0.0, 1.2, 0.0]])  # 0.5 < lo, 3 > C
    assert m["sampling/is_masked_frac"] == pytest.approx(2 / 5)
    w, _ = _w("token_mis", cap=2.5)  # lo defaults to 1/2.5 = 0.4 -> 0.5 kept
    _rows(w, [[2.0, 0.5, 1.0], [0.0, 1.2, 0.0]])


def test_seq_tis():
    w, m = _w("seq_tis")  # rho(y) = 1 and 3.6, C = 2
    _rows(w, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    assert m["sampling/is_truncated_frac"] == pytest.approx(0.5)  # one of two sequences


def test_seq_mis():
    w, m = _w("seq_mis")  # C = 10: both kept
    _rows(w, [[1.0, 1.0, 1.0], [3.6, 3.6, 0.0]])
    assert m["sampling/is_masked_frac"] == 0.0
    w, m = _w("seq_mis", cap=3.0)
    _rows(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert m["sampling/is_masked_frac"] == pytest.approx(0.5)


def test_geo_mis():
    g1 = math.sqrt(3.6)  # exp(log(3.6) / 2) = 1.8974
    w, m = _w("geo_mis")
    _rows(w, [[1.0, 1.0, 1.0], [g1, g1, 0.0]])
    assert m["sampling/is_weight_max"] == pytest.approx(1.8973665961)
    w, m = _w("geo_mis", cap=1.5)  # 1.897 > 1.5 -> masked; row 0 g = 1 inside [1/1.5, 1.5]
    _rows(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert m["sampling/is_masked_frac"] == pytest.approx(0.5)


def test_long_sequence_ratio_does_not_overflow():
    # 2000 tokens each with log rho = 1: rho(y) = e^2000 overflows fp64; TIS caps, MIS masks, no inf/nan
    t = torch.ones(1, 2000, dtype=torch.float64)
    r = torch.zeros(1, 2000, dtype=torch.float64)
    mask = torch.ones(1, 2000)
    w, m = is_weights("seq_tis", t, r, mask)
    assert torch.all(w == 2.0)
    w, m = is_weights("seq_mis", t, r, mask)
    assert torch.all(w == 0.0) and m["sampling/is_masked_frac"] == 1.0
    w, _ = is_weights("geo_mis", t, r, mask)
    assert w[0].tolist() == pytest.approx([math.e] * 2000)


def test_bad_kind_and_bounds():
    with pytest.raises(QerlError):
        is_weights("tis", TRAIN, ROLL, MASK)
    with pytest.raises(QerlError):
        is_weights("seq_tis", TRAIN, ROLL, MASK, lo=0.5)
    with pytest.raises(QerlError):
        is_weights("token_mis", TRAIN, ROLL, MASK, cap=2.0, lo=3.0)

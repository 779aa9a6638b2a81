"""Policy losses against hand-computed values and gradients (2 sequences x 3 positions, fp64)."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.losses import entropy_from_logits, policy_loss, resolve_clip, token_entropy

D = torch.float64
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, 0.0]], dtype=D)
# Token ratios r = pi/pi_old: row 0 [1.0, 1.5, 0.5] (A = +1), row 1 [1.1, 0.7, pad] (A = -2).
RATIOS = [[1.0, 1.5, 0.5], [1.1, 0.7]]
ADV = torch.tensor([1.0, -2.0], dtype=D)


def _logp_from(deltas: list[list[float]]) -> torch.Tensor:
    """old + delta on real tokens; -inf at the padding slot to prove padding never leaks into the loss."""
    rows = []
    for i, row in enumerate(deltas):
        vals = [OLD[i, t].item() + row[t] for t in range(len(row))]
        rows.append(vals + [-math.inf] * (3 - len(vals)))
    return torch.tensor(rows, dtype=D, requires_grad=True)


def _ratio_logp() -> torch.Tensor:
    return _logp_from([[math.log(r) for r in row] for row in RATIOS])


def _grad(loss: torch.Tensor, logp: torch.Tensor) -> list[list[float]]:
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all()
    return g.tolist()


def test_grpo_value_gradient_and_clip_metrics():
    logp = _ratio_logp()
    loss, metrics = policy_loss("grpo", logp, OLD, ADV, MASK)
    # row 0 (A=+1): -min(r, clip(r, .8, 1.2)) = -1, -1.2 (clipped), -0.5 (min keeps r) -> mean -0.9
    # row 1 (A=-2): -min(-2r, -2clip(r)) = 2.2, 1.6 (0.7 clipped up to 0.8)           -> mean  1.9
    assert loss.item() == pytest.approx((-0.9 + 1.9) / 2, abs=1e-12)
    # d/dlogp of -r*A on unclipped tokens = -r*A, / tokens in the row, / B
    g = _grad(loss, logp)
    expected = [[-1.0 / 3 / 2, 0.0, -0.5 / 3 / 2], [2.2 / 2 / 2, 0.0, 0.0]]
    for row, exp_row in zip(g, expected, strict=True):
        assert row == pytest.approx(exp_row, abs=1e-12)
    # A > 0 tokens: the gradient of the loss is negative, so descent raises their log-prob
    assert g[0][0] < 0 and g[1][0] > 0
    # clipped in the direction that matters: (1,1) r=0.7<0.8 with A<0; (0,1) r=1.5>1.2 with A>0.
    # (0,2) r=0.5 with A>0 is NOT counted (the min keeps the unclipped term).
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert "kl" not in metrics


def test_dapo_clip_higher_and_token_level_mean():
    logp = _ratio_logp()
    loss, metrics = policy_loss("dapo", logp, OLD, ADV, MASK)
    # eps_high 0.28: r=1.5 clips at 1.28. token losses -1, -1.28, -0.5, 2.2, 1.6 over 5 tokens
    assert loss.item() == pytest.approx((-1 - 1.28 - 0.5 + 2.2 + 1.6) / 5, abs=1e-12)
    g = _grad(loss, logp)
    assert g[0] == pytest.approx([-1.0 / 5, 0.0, -0.5 / 5], abs=1e-12)
    assert g[1] == pytest.approx([2.2 / 5, 0.0, 0.0], abs=1e-12)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)


def test_dapo_token_mean_differs_from_grpo_sequence_mean():
    # Same clip range, different aggregation: grpo averages per sequence (3 and 2 tokens), dapo over 5.
    grpo, _ = policy_loss("grpo", _ratio_logp(), OLD, ADV, MASK)
    dapo, _ = policy_loss("dapo", _ratio_logp(), OLD, ADV, MASK, epsilon_high=0.2)
    assert grpo.item() == pytest.approx((-2.7 / 3 + 3.8 / 2) / 2, abs=1e-12)
    assert dapo.item() == pytest.approx((-2.7 + 3.8) / 5, abs=1e-12)
    # a token of the short sequence weighs 1/(2*2) under grpo, 1/5 under dapo
    g_grpo = _grad(policy_loss("grpo", lp := _ratio_logp(), OLD, ADV, MASK)[0], lp)
    g_dapo = _grad(policy_loss("dapo", lp2 := _ratio_logp(), OLD, ADV, MASK, epsilon_high=0.2)[0], lp2)
    assert g_grpo[1][0] == pytest.approx(2.2 / 4) and g_dapo[1][0] == pytest.approx(2.2 / 5)


def test_dr_grpo_constant_normaliser():
    logp = _ratio_logp()
    loss, _ = policy_loss("dr_grpo", logp, OLD, ADV, MASK, max_completion_length=4)
    assert loss.item() == pytest.approx((-2.7 + 3.8) / (2 * 4), abs=1e-12)
    g = _grad(loss, logp)
    assert g[0] == pytest.approx([-1.0 / 8, 0.0, -0.5 / 8], abs=1e-12)
    assert g[1] == pytest.approx([2.2 / 8, 0.0, 0.0], abs=1e-12)
    # the normaliser does not depend on how many tokens the sequences have
    loss10, _ = policy_loss("dr_grpo", _ratio_logp(), OLD, ADV, MASK, max_completion_length=10)
    assert loss10.item() == pytest.approx(1.1 / 20, abs=1e-12)
    with pytest.raises(QerlError):
        policy_loss("dr_grpo", _ratio_logp(), OLD, ADV, MASK)


def test_loss_normalizer_for_micro_batches():
    # splitting the batch in two micro-batches with the full-batch normaliser sums to the full loss
    full, _ = policy_loss("dapo", _ratio_logp(), OLD, ADV, MASK)
    lp = _ratio_logp()
    a, _ = policy_loss("dapo", lp[:1], OLD[:1], ADV[:1], MASK[:1], loss_normalizer=5.0)
    b, _ = policy_loss("dapo", lp[1:], OLD[1:], ADV[1:], MASK[1:], loss_normalizer=5.0)
    assert (a + b).item() == pytest.approx(full.item(), abs=1e-12)


def test_gspo_sequence_ratio_clip_and_per_token_gradient():
    d0 = [3e-4, -1e-4, 1e-4]  # mean 1e-4 -> s0 = exp(1e-4), inside [1-3e-4, 1+4e-4]
    d1 = [2e-3, 0.0]  # mean 1e-3 -> s1 = exp(1e-3) > 1+4e-4
    logp = _logp_from([d0, d1])
    adv = torch.tensor([-1.0, 1.0], dtype=D)
    loss, metrics = policy_loss("gspo", logp, OLD, adv, MASK)
    s0 = math.exp(1e-4)
    # row 0 (A=-1): -min(-s0, -s0) = s0 for every token; row 1 (A=+1): -min(s1, 1.0004) = -1.0004
    assert loss.item() == pytest.approx((s0 - 1.0004) / 2, abs=1e-12)
    g = _grad(loss, logp)
    # every token of row 0 gets s0 * (-A) / |y| / B although its own token ratio differs; row 1 clipped
    assert g[0] == pytest.approx([s0 / 3 / 2] * 3, abs=1e-12)
    assert g[1] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    # fractions of sequences (TRL: sequence-level ratios)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert metrics["clip_ratio/low_mean"] == 0.0
    # token-level GRPO with the same tiny clip range would clip nothing in row 0 but weigh tokens by r_t
    g_tok = _grad(policy_loss("grpo", lp := _logp_from([d0, d1]), OLD, adv, MASK, epsilon=3e-4,
                              epsilon_high=4e-4)[0], lp)
    assert g_tok[0] == pytest.approx([math.exp(x) / 6 for x in d0], abs=1e-12)


def test_gspo_low_clip():
    logp = _logp_from([[-1e-3, -1e-3, -1e-3], [0.0, 0.0]])
    adv = torch.tensor([-1.0, 1.0], dtype=D)
    loss, metrics = policy_loss("gspo", logp, OLD, adv, MASK)
    # row 0: s = exp(-1e-3) < 0.9997 with A<0 -> -min(-s, -0.9997) = 0.9997; row 1: s=1 -> -1
    assert loss.item() == pytest.approx((0.9997 - 1.0) / 2, abs=1e-12)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(0.5)


ROLL_DIFF = [[0.1, 0.2, -0.1], [0.5, 0.7]]  # log pi_old - log mu per token: rho(y) = e^0.2, e^1.2


def _mu() -> torch.Tensor:
    rows = [[OLD[i, t].item() - ROLL_DIFF[i][t] for t in range(len(ROLL_DIFF[i]))] for i in range(2)]
    rows[1].append(0.0)
    return torch.tensor(rows, dtype=D)


def test_pg_seq_is_and_tis_cap():
    logp = _logp_from([[0.0, 0.0, 0.0], [0.0, 0.0]])  # on-policy: logp == old_logp
    # sum_t log pi(y_t): row 0 -3.5, row 1 -0.7
    loss, m = policy_loss("pg_seq_is", logp, OLD, ADV, MASK, rollout_logp=_mu())
    r0, r1 = math.exp(0.2), math.exp(1.2)
    assert loss.item() == pytest.approx((-r0 * 1 * -3.5 + -r1 * -2 * -0.7) / 2, abs=1e-12)
    g = _grad(loss, logp)
    assert g[0] == pytest.approx([-r0 / 2] * 3, abs=1e-12)
    assert g[1] == pytest.approx([r1, r1, 0.0], abs=1e-12)
    assert m["seq_is/capped_frac"] == 0.0 and m["seq_is/rho_max"] == pytest.approx(r1)

    logp = _logp_from([[0.0, 0.0, 0.0], [0.0, 0.0]])
    loss, m = policy_loss("pg_seq_tis", logp, OLD, ADV, MASK, rollout_logp=_mu())
    assert loss.item() == pytest.approx((3.5 * r0 - 1.4 * 3.0) / 2, abs=1e-12)
    g = _grad(loss, logp)
    assert g[1] == pytest.approx([3.0, 3.0, 0.0], abs=1e-12)  # -(3)(-2)/B
    assert m["seq_is/capped_frac"] == pytest.approx(0.5)
    assert m["seq_is/rho_mean"] == pytest.approx((r0 + 3.0) / 2)
    assert m["seq_is/rho_min"] == pytest.approx(r0)

    loss2, _ = policy_loss("pg_seq_tis", _logp_from([[0.0] * 3, [0.0] * 2]), OLD, ADV, MASK,
                           rollout_logp=_mu(), seq_is_cap=1.0)
    assert loss2.item() == pytest.approx((3.5 * 1.0 - 1.4 * 1.0) / 2, abs=1e-12)
    with pytest.raises(QerlError):
        policy_loss("pg_seq_is", _ratio_logp(), OLD, ADV, MASK)


def test_kl_k3_added_per_token():
    dref = [[0.5, -0.5, 0.0], [1.0, 0.0]]  # ref - logp
    logp = _logp_from([[0.0] * 3, [0.0] * 2])  # ratio 1
    ref = torch.tensor([[OLD[0, 0] + 0.5, OLD[0, 1] - 0.5, OLD[0, 2]], [OLD[1, 0] + 1.0, OLD[1, 1], 0.0]],
                       dtype=D)
    adv = torch.zeros(2, dtype=D)  # isolate the KL term
    loss, m = policy_loss("grpo", logp, OLD, adv, MASK, ref_logp=ref, beta=0.1)
    k = [[math.exp(x) - x - 1 for x in row] for row in dref]
    assert k[0][0] == pytest.approx(0.1487212707) and k[1][0] == pytest.approx(0.7182818285)
    assert loss.item() == pytest.approx(0.1 * (sum(k[0]) / 3 + sum(k[1]) / 2) / 2, abs=1e-12)
    assert m["kl"] == pytest.approx((sum(k[0]) + sum(k[1])) / 5, abs=1e-12)
    g = _grad(loss, logp)
    # d k3 / d logp = 1 - exp(ref - logp)
    assert g[0] == pytest.approx([0.1 * (1 - math.exp(x)) / 3 / 2 for x in dref[0]], abs=1e-12)
    assert g[1][:2] == pytest.approx([0.1 * (1 - math.exp(x)) / 2 / 2 for x in dref[1]], abs=1e-12)
    with pytest.raises(QerlError):
        policy_loss("grpo", _ratio_logp(), OLD, ADV, MASK, beta=0.1)


def test_is_weights_multiply_token_loss():
    w = torch.tensor([[2.0, 1.0, 0.5], [0.5, 1.0, 0.0]], dtype=D)
    loss, _ = policy_loss("grpo", _ratio_logp(), OLD, ADV, MASK, is_weights=w)
    # row 0: [-1*2, -1.2*1, -0.5*0.5] mean -1.15; row 1: [2.2*0.5, 1.6*1] mean 1.35
    assert loss.item() == pytest.approx((-1.15 + 1.35) / 2, abs=1e-12)


def test_resolve_clip_defaults():
    assert resolve_clip("grpo", None, None) == (0.2, 0.2)
    assert resolve_clip("grpo", 0.1, None) == (0.1, 0.1)
    assert resolve_clip("dapo", None, None) == (0.2, 0.28)
    assert resolve_clip("gspo", None, None) == (3e-4, 4e-4)
    with pytest.raises(QerlError):
        policy_loss("ppo", _ratio_logp(), OLD, ADV, MASK)


def test_entropy_chunked():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, -math.inf, -math.inf]]],
        dtype=D,
    )
    ent = token_entropy(logits, chunk_size=2)
    assert ent[0].tolist() == pytest.approx([math.log(3), 1.5 * math.log(2), 0.0], abs=1e-12)
    mean = entropy_from_logits(logits, torch.tensor([[1, 1, 0]]), chunk_size=1)
    assert mean.item() == pytest.approx((math.log(3) + 1.5 * math.log(2)) / 2, abs=1e-12)

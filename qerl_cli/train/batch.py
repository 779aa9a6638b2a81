"""Turn rollouts into padded training tensors, and compute sampled-token log-probs with the training forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qerl_cli.train.losses import token_entropy


@dataclass
class RolloutBatch:
    """Right-padded prompt+completion rows; completion positions are where `mask` is 1.

    `rollout_logp` [B, T] holds the engine's log-probs of the sampled tokens (mu), aligned with the
    completion tokens; T = longest completion. In an episode the completion holds the model's turns and the
    observations between them: `sampled` is 1 on the model's tokens only (0 on observations and padding), and
    `mask` is 0 on observations, so the loss, the log-probs and the mismatch statistics skip them.
    """

    input_ids: torch.Tensor  # [B, L] prompt + completion, right padded
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    completion_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float, 1 on completion tokens kept for the loss
    rollout_logp: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B] completion lengths
    truncated: torch.Tensor  # [B] bool, hit max length without a stop
    sampled: torch.Tensor  # [B, T] float, 1 on the tokens the model sampled (not observations, not padding)
    # a mixture of experts' routing as the rollout engine recorded it, laid out like input_ids: [B, L, layers, k]
    # int16, -1 where nothing was recorded (padding, the last token); None without one (routing replay, docs/moe.md)
    routing: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(*(_map(getattr(self, f), lambda t: t.to(device)) for f in self.__dataclass_fields__))

    def rows(self, idx: slice) -> RolloutBatch:
        return RolloutBatch(*(_map(getattr(self, f), lambda t: t[idx]) for f in self.__dataclass_fields__))


def _map(t: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if t is None else fn(t)


def routing_rows(routings: list[torch.Tensor | None], lengths: list[int], width: int) -> torch.Tensor | None:
    """The recorded routings ``[n_i, layers, k]`` (``Sample.routing``) as ``[B, width, layers, k]`` int16, right
    padded like input_ids with -1 (no recorded experts: the forward routes those tokens itself); None unless every
    sample has one."""
    if not routings or any(r is None for r in routings):
        return None
    first = routings[0]
    out = torch.full((len(routings), width, *first.shape[1:]), -1, dtype=torch.int16)
    for i, (r, n) in enumerate(zip(routings, lengths, strict=True)):
        m = min(n, r.shape[0])
        out[i, :m] = r[:m].to(torch.int16)
    return out


def build_batch(prompts: list[list[int]], completions: list[list[int]], rollout_logps: list[torch.Tensor],
                truncated: list[bool], pad_id: int, mask_truncated: bool = False,
                model_masks: list[torch.Tensor] | None = None,
                routings: list[torch.Tensor | None] | None = None) -> RolloutBatch:
    """The padded batch; ``model_masks[i]`` (1 on model tokens, 0 on observation tokens: ``Sample.model_mask``)
    for episodes, None for single-turn completions (every completion token is the model's). ``routings``: each
    sample's recorded routing (``Sample.routing``) for routing replay."""
    b = len(prompts)
    t = max(1, max(len(c) for c in completions))
    lmax = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    input_ids = torch.full((b, lmax), pad_id, dtype=torch.long)
    attn = torch.zeros((b, lmax), dtype=torch.long)
    comp = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.float32)
    mu = torch.zeros((b, t), dtype=torch.float32)
    sampled = torch.zeros((b, t), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logps, strict=True)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        if c:
            comp[i, : len(c)] = torch.tensor(c)
            sampled[i, : len(c)] = 1.0 if model_masks is None else model_masks[i][: len(c)].float()
            mask[i, : len(c)] = 0.0 if (mask_truncated and truncated[i]) else sampled[i, : len(c)]
            mu[i, : len(c)] = lp[: len(c)].float() * sampled[i, : len(c)]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    return RolloutBatch(input_ids, attn, torch.tensor([len(p) for p in prompts]), comp, mask, mu,
                        torch.tensor([len(c) for c in completions]), torch.tensor(truncated), sampled,
                        routing_rows(routings or [], lengths, lmax))


def sampled_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t) [B, T] under logits / temperature (the distribution the rollout sampled), fp32.

    Only the completion positions' logits are materialised in fp32, to bound memory.
    """
    b, t = batch.completion_ids.shape
    seq_len = batch.input_ids.shape[1]
    # logits at position j predict token j+1: completion token k sits at prompt_len + k. Only the window
    # of positions that some row needs goes through lm_head (the vocab projection dominates small models).
    first = int(batch.prompt_lens.min()) - 1
    last = min(int(batch.prompt_lens.max()) - 1 + t, seq_len)
    keep = torch.arange(first, last, device=batch.input_ids.device)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                logits_to_keep=keep)
    logits = out.logits  # [B, last - first, V]
    pos = (batch.prompt_lens.unsqueeze(1) - 1 - first + torch.arange(t, device=logits.device).unsqueeze(0))
    pos = pos.clamp(max=logits.shape[1] - 1)
    sel = logits.gather(1, pos.unsqueeze(-1).expand(b, t, logits.shape[-1])).float() / temperature
    logp_all = torch.log_softmax(sel, dim=-1)
    logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = token_entropy(sel.detach()) if with_entropy else None
    return logp * (batch.mask > 0), entropy

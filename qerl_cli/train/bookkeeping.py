"""What a run keeps besides the weights: its metrics lines, the rollouts it logs, the checkpoint it resumes from
and the settings a resumed run must share with it. On-disk names and formats are train/checkpointing.py's and
qerl_cli/runlayout.py's; this module only decides when each is read or written (rank 0 writes, every rank reads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.metricsfile import append_metrics, read_metrics, write_metrics
from qerl_cli.runlayout import metrics_path, rollouts_dir
from qerl_cli.train import checkpointing
from qerl_cli.train.checkpointing import NoCheckpointError, resolve_checkpoint

if TYPE_CHECKING:
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.distributed import DistContext
    from qerl_cli.train.modes import TrainingMode
    from qerl_cli.train.rollouter import EpisodeKind, Group

# what a resumed run must share with its checkpoint (other options may change between the two)
RESUME_KEYS = ("algo", "lora_rank", "lora_targets", "precision", "seed", "task", "aqn", "finetune", "rollout_quant",
               "requant_scales")


def check_resume_settings(cfg: TrainConfig, ckpt: Path, state: dict[str, Any], mode: TrainingMode) -> None:
    """Refuse to continue a checkpoint with settings it was not trained with (``cfg`` resolved), or one another
    training mode wrote."""
    saved = state.get("config", {})
    for key in RESUME_KEYS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise QerlError(f"--resume with a different {key} ({getattr(cfg, key)!r}, checkpoint has "
                            f"{saved[key]!r}): use the original settings or a new --run directory")
    mode.check_checkpoint(ckpt)


def read_trainer_state(run: RunDir, ckpt: Path) -> dict[str, Any]:
    """A verified checkpoint's trainer state; an unreadable one is the same one line as a damaged file."""
    try:
        return checkpointing.load_checkpoint(ckpt)
    except checkpointing.CheckpointDamaged as err:
        raise QerlError(checkpointing.damaged_message(run, err, "resume")) from err


class Bookkeeper:
    """The run directory's metrics file and rollout logs, and where a resume starts (module docstring)."""

    def __init__(self, run: RunDir, cfg: TrainConfig, dist: DistContext) -> None:
        self.run, self.cfg, self.dist = run, cfg, dist
        self.metrics_path = metrics_path(run)
        self.rollouts_dir = rollouts_dir(run)

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        if self.dist.is_main:
            append_metrics(self.metrics_path, metrics)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines of steps after the checkpoint (they will be recomputed identically)."""
        if not self.dist.is_main or not self.metrics_path.is_file():
            return
        rows = read_metrics(self.metrics_path, covered=step)
        write_metrics(self.metrics_path, [r for r in rows if r["step"] <= step])

    def resume_point(self, ckpt: Path | None, state: dict[str, Any] | None) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to continue from and its trainer state: ``ckpt`` and ``state`` where the caller verified
        and loaded them, else `latest` (verified here); None when there is none (the metrics of a run killed before
        its first checkpoint are dropped: it starts over cleanly)."""
        if ckpt is None:
            try:
                ckpt = resolve_checkpoint(self.run, "latest")
            except NoCheckpointError:
                self.truncate_metrics(0)
                return None
            assert ckpt is not None
            checkpointing.require_intact(self.run, ckpt, "resume")
        if state is None:
            state = read_trainer_state(self.run, ckpt)
        return ckpt, state

    def log_rollouts(self, groups: list[Group], adv: torch.Tensor, step: int, examples: list[Any],
                     episodes: EpisodeKind) -> None:
        """--log-rollouts: one JSONL line per sample of step ``step`` (``examples``: the task's)."""
        if not self.cfg.log_rollouts or not self.dist.is_main:
            return
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        k = 0
        for idx, samples, raw, shaped in groups:
            ex = examples[idx]
            for j, s in enumerate(samples):
                lp = s.logprobs
                lines.append(json.dumps({
                    "prompt_index": idx, "sample": j, "prompt": ex.prompt[-500:], "answer": ex.answer,
                    "completion": s.text, "reward": raw[j].item(), "shaped_reward": shaped[j].item(),
                    "advantage": adv[k].item(), "length": len(s.token_ids), "finish_reason": s.finish_reason,
                    "logprob_sum": float(lp.sum()) if lp.numel() else 0.0,
                    "logprob_min": float(lp.min()) if lp.numel() else 0.0,
                    **({} if getattr(s, "policy_version", None) is None else {"version": s.policy_version}),
                    **({} if getattr(s, "policy_version_last", None) in (None, getattr(s, "policy_version", None))
                       else {"version_last": s.policy_version_last}),
                    **episodes.record(s),
                }))
                k += 1
        from qerl_cli.manifest import atomic_write_text

        atomic_write_text(self.rollouts_dir / f"step_{step:05d}.jsonl", "\n".join(lines) + "\n")

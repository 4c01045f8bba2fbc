"""A run whose loss went nan or inf stops (DivergedError) before it checkpoints or exports the weights.

No bf16 loss scaler skips a step here: one nan gradient makes AdamW's moments, then every weight,
nan, so a non-finite step ends the run, naming the setting to lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from dflash.runtime.findings import Finding
from dflash.train.config import DivergedError, OptimizationConfig, TrainConfig
from dflash.train.measure.reporting import RunningMetrics
from dflash.train.run.distributed import DistInfo, any_rank
from torch import nn


class DivergenceGuard:
    """Raises DivergedError once the run's loss or gradient norm was nan or inf, or its weights are."""

    def __init__(self, metrics: RunningMetrics, model: nn.Module, cfg: TrainConfig, info: DistInfo, *,
                 latest_checkpoint: Callable[[], Path | None], final_dir: Path,
                 before_raise: Callable[[], None] = lambda: None):
        self.metrics, self.model, self.cfg, self.info = metrics, model, cfg, info
        self.latest_checkpoint, self.final_dir, self.before_raise = latest_checkpoint, final_dir, before_raise

    def check(self, step: int, last: dict[str, float] | None = None) -> None:
        """Given `last` (a log's metrics, reduced over ranks: the same on every rank), its loss and
        gradient norm decide; else (before a checkpoint or the export) the device's note of a
        non-finite step and the weights themselves, agreed over ranks."""
        if last is not None:
            if all(math.isfinite(last[k]) for k in ("loss", "grad_norm")):
                return
            bad = int(self.metrics.first_nonfinite.item()) or step
        else:
            bad = self.metrics.nonfinite_step(self.info)
            if not bad and not any_rank(int(not weights_finite(self.model)), self.info):
                return
        self.before_raise()
        raise DivergedError(diverged(bad or step, self.cfg, last, self.latest_checkpoint(), self.final_dir))


@torch.no_grad()
def weights_finite(model: nn.Module) -> bool:
    """Whether every trainable weight (this rank's shard under FSDP) is finite (a host sync)."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
             for p in model.parameters() if p.requires_grad]
    return bool(torch.stack(flags).all()) if flags else True


def diverged(step: int, cfg: TrainConfig, last: dict[str, float] | None, checkpoint: Path | None,
             final_dir: Path) -> Finding:
    """What a run whose loss went nan or inf is stopped with (DivergedError): the step, the logged
    loss and gradient norm, what was kept (the last checkpoint, an earlier export) and the --lr."""
    return Finding("train.loss-diverged", step=step, loss=last["loss"] if last else None,
                   grad_norm=last["grad_norm"] if last else None, lr=cfg.optimization.lr,
                   default_lr=OptimizationConfig.lr, checkpoint=str(checkpoint) if checkpoint is not None else None,
                   final=str(final_dir), final_kept=(final_dir / "config.json").is_file(),
                   grad_clip_off=cfg.optimization.grad_clip == 0)

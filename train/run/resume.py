"""What a resumed run shares with its checkpoint, and the resume itself: the identity a checkpoint
must match (data, batches, model shape), and loading the latest checkpoint of a run directory
with the settings of this run (a changed --lr or --weight-decay takes effect from the resumed step)."""

from __future__ import annotations

from typing import Any

import torch
from dflash.cache_tools.identity import comparable, target_identity
from dflash.runtime.findings import Finding
from dflash.runtime.settings import identity_of
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.data.caches import TrainingData
from dflash.train.measure.reporting import RunLogger
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.run.checkpoint import Checkpointer, TrainState, compute_changes
from dflash.train.run.distributed import DistInfo
from dflash.train.run.notices import tell


def run_identity(cfg: TrainConfig, data: TrainingData, drafter: DFlashDrafter, target_config: Any,
                 info: DistInfo) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint: the data, its batches, the model's shape.
    The settings in it are those train/config.py marks `identity=` (the shape as the drafter's
    config resolved it); the rest are facts of the run: its caches, target and head."""
    c = drafter.config
    settings = identity_of(cfg, resolved={"model": c},
                           values={"grad_accum": info.world_size * cfg.optimization.grad_accum})
    return {
        **settings,
        "caches": data.caches.identity(),
        "eval_caches": data.eval_caches.identity() if data.eval_caches is not None else [],
        "eval_split": "sample_id hash",  # the held-out split (by sample id) decides the training samples
        # the target's identity (cache_tools.identity): its files, never its path
        "target": comparable(target_identity(target_config, cfg.model.target_model)),
        "batching": {**settings["batching"], "sample_order": "sample_id"},
        "model": {**settings["model"], "target_layer_ids": list(c.target_layer_ids),
                  **drafter.head.identity(c)},  # the head's settings (none for DFlash, as recorded before heads)
    }


def resume(cfg: TrainConfig, checkpoints: Checkpointer, state: TrainState, log: RunLogger) -> int:
    """Load the latest checkpoint of this run directory into `state` (refused when it is not this
    run's: checkpoint.check_resume); returns the step to continue from."""
    latest = checkpoints.latest()
    if latest is None:
        if cfg.logging.resume:
            raise TrainConfigError(Finding("train.resume-no-checkpoint", checkpoints=str(checkpoints.dir)))
        if (aside := log.set_aside()) is not None:
            tell(log, Finding("train.metrics-set-aside", file=str(log.path), aside=aside.name))
        return 0
    optimizer, scheduler = state.optimizer, state.scheduler
    # this run's settings, as build_optimizer gave them to each group (the scheduler, built since,
    # moved its lr to the first step's and kept --lr as its initial_lr)
    built = [{"lr": group["initial_lr"], **{k: group[k] for k in OPTIMIZER_SETTINGS}} for group in optimizer.param_groups]
    ckpt, notes = checkpoints.restore(state, latest, state.identity)
    for notice in notes:
        tell(log, notice)
    apply_optimizer_settings(optimizer, scheduler, built)
    data_epoch = state.loader.epoch
    if dropped := log.keep_until(ckpt.step):
        tell(log, Finding("train.metrics-dropped", file=str(log.path), records=dropped, step=ckpt.step))
    now = cfg.to_dict()
    changed = {k: (v, now[k]) for k, v in ckpt.meta.get("config", {}).items() if k in now and now[k] != v}
    log.info(f"Resuming from {latest} (step {ckpt.step}, epoch {data_epoch}). To start over, "
             "use a new --output-dir.")
    if changed:
        tell(log, Finding("train.resume-settings-changed", changes=[[k, old, new] for k, (old, new) in changed.items()],
                          former_defaults=former_defaults(changed)))
    tell(log, compute_changes(ckpt.meta.get("compute")))
    return ckpt.step


OPTIMIZER_SETTINGS = ("betas", "eps", "weight_decay")
"""What each param group takes from the run's settings besides its lr (--adam-betas, --adam-eps, --weight-decay)."""


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, scheduler: Any, built: list[dict[str, Any]]) -> None:
    """Give each param group the settings it was built with by this run (`built`, as
    `build_optimizer` made it: a group without weight decay keeps 0), over those a checkpoint's
    state restored: the optimizer's and the scheduler's state dicts restore the saved lr, betas,
    eps, weight decay and base lrs, so a resume with a new --lr or --weight-decay would train on
    with the old ones. The lr of the resumed step is the new base lr on the schedule's multiplier
    there (the same value when nothing changed: the scheduler computes it so)."""
    for group, settings in zip(optimizer.param_groups, built, strict=True):
        for key in OPTIMIZER_SETTINGS:
            group[key] = settings[key]
        group["initial_lr"] = settings["lr"]
    if list(scheduler.base_lrs) != [g["lr"] for g in built]:
        scheduler.base_lrs = [g["lr"] for g in built]
        for group, base, multiplier in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                           strict=True):
            group["lr"] = base * multiplier(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


FORMER_DEFAULTS = {"epochs": 6, "soft_label_weight": 0.0, "hard_label": "sample"}
"""Defaults of earlier versions (now 10 epochs, soft labels where the cache has them, and DFlash2
toward the target's top-1): a run started under them and resumed by the same command takes the
new ones unless told."""


def former_defaults(changed: dict[str, tuple[Any, Any]]) -> list[list[Any]]:
    """For the resume's notice: the changed settings that were at a former default, [key, value]
    each (how to finish a run as it started when only a default changed under it)."""
    return [[k, old] for k, (old, _) in changed.items() if k in FORMER_DEFAULTS and old == FORMER_DEFAULTS[k]]

"""The training loop: `train(config)` reads top to bottom; each piece it wires lives in its own module.

data and anchors (loader.py, anchors.py) -> drafter (model.py) -> loss (objective.py) ->
optimizer/schedule (here) -> held-out estimate (evaluation.py) -> metrics and logs (reporting.py)
-> a nan guard (divergence.py) -> checkpoints of the TrainState (checkpoint.py), over any number of
processes (distributed.py), stopped cleanly by SIGINT/SIGTERM (runtime.signals).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.runtime.locks import WriterLock
from dflash.runtime.signals import StopRequest, StopWaiting
from dflash.train.config import TrainConfig, TrainConfigError, process_cores
from dflash.train.data.anchors import AnchorDraw, noise_generator
from dflash.train.data.caches import TrainingData, check_cache_target, open_training_data
from dflash.train.data.follow import follow_fields, report_consumption
from dflash.train.data.loader import dequantize_batch
from dflash.train.data.shared_memory import fit_loader_memory
from dflash.train.exports.export import export_out_dir
from dflash.train.exports.warm_start import warm_start
from dflash.train.heads import get_head
from dflash.train.loss.objective import compute_loss, label_summary, stores_target_top1
from dflash.train.measure.evaluation import LossModel, evaluate
from dflash.train.measure.loader_watch import LoaderWatch
from dflash.train.measure.reporting import (
    HeldoutTracker,
    RunLogger,
    RunningMetrics,
    StepProfiler,
    gpu_memory_gib,
)
from dflash.train.model.attention import refuse_backend_off_its_device
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.target_weights import load_target_config
from dflash.train.run.checkpoint import (
    MODEL_FILE,
    Checkpointer,
    RunCheckpoints,
    TrainState,
    export_from_state,
    step_dir_name,
    training_target,
)
from dflash.train.run.distributed import (
    DistInfo,
    any_rank,
    barrier,
    full_state,
    init_distributed,
    unwrap,
    wrap_model,
)
from dflash.train.run.divergence import DivergenceGuard
from dflash.train.run.memory import fit_to_device
from dflash.train.run.notices import tell
from dflash.train.run.resume import resume, run_identity
from dflash.train.run.run_length import RunLength
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute


@dataclass
class TrainResult:
    """How a run ended."""

    step: int
    exit_status: int
    """0 finished, 130 stopped by SIGINT, 143 by SIGTERM (a checkpoint of `step` was written)."""
    checkpoint: Path | None
    final_dir: Path | None
    metrics: dict[str, float]
    eval_metrics: dict[str, Any] | None
    best_step: int | None = None
    """The step of the best held-out evaluation: its checkpoint is kept and is what final_dir holds."""


RUN_LOCK_FILE = ".run.lock"  # held by the run writing the directory (runtime.locks)
FINAL_DIR = "final"  # the exported drafter, written when the run ends (export_final)


def train(cfg: TrainConfig) -> TrainResult:
    with contextlib.ExitStack() as cleanup:
        return _train(cfg, cleanup)


def _train(cfg: TrainConfig, cleanup: contextlib.ExitStack) -> TrainResult:
    run = start_run(cfg, cleanup)  # data, drafter, optimizer, the resumed TrainState, checkpoints
    state, data, log = run.state, run.data, run.log
    log.start(run.total_steps, state.step)
    with StopRequest(finishing="finishing this step, writing a checkpoint, then exiting",
                     abandoning="exiting now without a checkpoint") as stop:
        while state.step < run.total_steps:
            position = data.loader.state_dict()  # where a stop while waiting for data goes back to
            try:
                train_step(run)  # batch -> forward -> loss -> backward (x grad_accum) -> clip -> step
            except StopWaiting:  # (--follow: a part not extracted yet)
                return stop_waiting(run, stop, position)
            state.step += 1
            log.advance(1)
            if (report := run.profiler.report()) is not None:
                log.info(f"[step {state.step}] {report}")
            eval_due = run.eval_due()
            if run.log_due() or eval_due:
                run.last = log_train_metrics(run)  # CPU-GPU sync point: only every log_interval steps
            new_best = False
            if eval_due:
                try:
                    new_best = evaluate_heldout(run)
                except StopWaiting:  # (--follow: held-out samples of parts not extracted yet)
                    return stop_waiting(run, stop, data.loader.state_dict())
            # A signal on any rank stops every rank after the same step (agreed on the CPU; a peer
            # that never comes to it is given up once a stop was asked for: runtime.signals).
            try:
                stopping = any_rank(stop.signum, run.info)
                if run.checkpoints.due(cfg.logging.save_interval) or stopping or new_best:
                    run.checkpoints.save()  # (never of nan weights: the guard refuses first)
            except StopWaiting:
                return stop_waiting(run, stop, data.loader.state_dict())
            if stopping:
                log.info(f"stopped at step {state.step}; rerun the same command to resume.")
                return run.result(stop.exit_status or 130)
    return finish_run(run)


# -- the pieces train() wires -------------------------------------------------------------------


@dataclass
class Run:
    """The components of one training run, wired by `start_run`."""

    cfg: TrainConfig
    info: DistInfo
    run_dir: Path
    log: RunLogger
    data: TrainingData
    drafter: DFlashDrafter
    model: nn.Module
    loss_model: LossModel
    autocast: contextlib.AbstractContextManager
    length: RunLength
    state: TrainState
    checkpoints: RunCheckpoints
    metrics: RunningMetrics
    profiler: StepProfiler
    guard: DivergenceGuard
    loader_watch: LoaderWatch
    last: dict[str, float] = field(default_factory=dict)
    """The last logged training metrics."""
    eval_metrics: dict[str, Any] | None = None
    """The last held-out evaluation's."""

    @property
    def total_steps(self) -> int:
        return self.length.total_steps

    def log_due(self) -> bool:
        step = self.state.step
        return step % self.cfg.logging.log_interval == 0 or step == self.total_steps

    def eval_due(self) -> bool:
        step, every = self.state.step, self.cfg.logging.eval_every(self.total_steps)
        return bool(every and step % every == 0) or step == self.total_steps

    def result(self, exit_status: int, final_dir: Path | None = None) -> TrainResult:
        self.log.close()
        return TrainResult(self.state.step, exit_status, self.checkpoints.last, final_dir, self.last,
                           self.eval_metrics, self.state.heldout.best_step)


def start_run(cfg: TrainConfig, cleanup: contextlib.ExitStack) -> Run:
    """Everything before the first step: the run directory, the data and its batch plan, the
    startup summary, the drafter, the optimizer and schedule, and the TrainState resumed from
    the latest checkpoint of this run when there is one."""
    info = init_distributed(cfg.runtime.device)
    run_dir = Path(cfg.logging.output_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # One run per directory: a second would delete the first's checkpoints and mix its logs.
        cleanup.enter_context(WriterLock(run_dir / RUN_LOCK_FILE, purpose="run", output=run_dir))
    refuse_foreign_final(run_dir / FINAL_DIR, info)
    log = RunLogger(run_dir, enabled=info.is_main, progress=cfg.logging.progress, tensorboard=cfg.logging.tensorboard)
    seed_everything(cfg.optimization.seed)

    # Data: manifests only. Every epoch's batch list is planned here, before any part is read.
    data = open_training_data(cfg, rank=info.rank, world_size=info.world_size,
                              pin_memory=info.device.type == "cuda")
    cleanup.callback(data.loader.close)  # however the run ends, its loader workers end with it
    # the batches its workers hand over through /dev/shm fit there (or fewer are in flight, and it says so)
    tell(log, fit_loader_memory(cfg.data, data))
    manifest = data.caches.manifest
    cfg = cfg.with_soft_labels(bool(manifest.store_last_hidden or manifest.topk)).with_hard_label(
        stores_target_top1(manifest))
    target_config = load_target_config_or_fail(cfg.model.target_model)
    for notice in check_cache_target(data.caches.manifest, target_config, cfg.model.target_model,
                                     caches=data.caches):
        tell(log, notice)
    log.info(data.summary())
    for caveat in data.caveats():
        tell(log, caveat, prefix="")  # (lines of the summary)
    if labels := label_summary(cfg.objective, manifest):
        log.info(labels.removeprefix("; ").replace("; hard labels", "\nhard labels"))
    length = RunLength.of(data.loader.steps_per_epoch, cfg.optimization.max_steps)  # --epochs, or --max-steps
    tell(log, length.cut_short())
    if schedule := length.schedule_line(cfg, heldout=bool(data.heldout_count)):
        log.info(schedule)
    if info.is_main and data.heldout_count:
        tell(log, data.unlike_heldout_note(cfg.model.block_size))
    refuse_nothing_to_learn(data, cfg.model.block_size)
    refuse_backend_off_its_device(cfg.model.attention_backend, info.device)
    # CUDA: the largest micro-batch must fit the device (the head's chunks shrink to fit, or a refusal
    # names a setting that fits), before the first step runs out of memory
    cfg = fit_to_device(cfg, target_config, data, info.device, functools.partial(tell, log),
                        world_size=info.world_size)

    # Model: the drafter's own weights plus the target's frozen embedding and lm_head (or, resumed,
    # the latest checkpoint's, loaded below: an --init-drafter is then not loaded).
    checkpointer = Checkpointer(run_dir, keep_checkpoints=cfg.logging.keep_checkpoints)
    drafter = build_drafter(cfg, data, announce=log.info, resume_from=checkpointer.latest()).to(info.device)
    model = wrap_model(drafter, cfg.runtime.parallel, info)
    optimizer = build_optimizer(cfg, model, info.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, total_steps=length.total_steps, warmup_ratio=cfg.optimization.warmup_ratio,
        min_lr_ratio=cfg.optimization.min_lr_ratio, schedule=cfg.optimization.lr_schedule,
        decay_ratio=cfg.optimization.decay_ratio))
    # The loader is the only producer of anchors: drawn where each batch is read (a loader
    # worker, off the training thread), seeded by the batch's place in the run.
    data.loader.prepare = AnchorDraw(cfg.optimization.seed, cfg.objective.max_anchors, drafter.config.block_size)

    # Resume from the latest complete checkpoint when there is one and it is this run's.
    identity = run_identity(cfg, data, drafter, target_config, info)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=data.loader,
                       heldout=HeldoutTracker(), identity=identity)
    state.step = resume(cfg, checkpointer, state, log)
    if info.is_main:
        checkpointer.remove_stale()

    metrics = RunningMetrics(drafter.config.block_size, info.device)
    guard = DivergenceGuard(metrics, model, cfg, info, latest_checkpoint=checkpointer.latest,
                            final_dir=run_dir / FINAL_DIR, before_raise=log.close)
    checkpoints = RunCheckpoints(
        checkpointer, state, info, guard=guard.check, announce=log.info,
        about={"config": cfg.to_dict(), "drafter_config": dataclasses.asdict(drafter.config),
               "world_size": info.world_size},
        # --follow: what a disk budget may evict
        after_save=functools.partial(report_consumption, data, info.rank, info.world_size))
    return Run(cfg=cfg, info=info, run_dir=run_dir, log=log, data=data, drafter=drafter, model=model,
               loss_model=LossModel(model, drafter), autocast=autocast_context(cfg.runtime.dtype, info.device),
               length=length, state=state, checkpoints=checkpoints, metrics=metrics,
               profiler=StepProfiler(cfg.logging.profile_interval, info.device), guard=guard,
               loader_watch=LoaderWatch(workers=cfg.data.num_workers, cores=process_cores(),
                                        watching=info.device.type == "cuda" and not data.caches.follows))


def train_step(run: Run) -> None:
    """One optimizer step: --grad-accum micro-batches (batch -> forward -> loss -> backward), then
    clip the gradients and step the optimizer and the schedule. The loader raises StopWaiting when
    a stop came while it waited for data."""
    cfg, data, info, profiler, step = run.cfg, run.data, run.info, run.profiler, run.state.step
    accum, optimizer = cfg.optimization.grad_accum, run.state.optimizer
    profiler.begin(step)
    run.model.train()
    wait_before = data.loader.wait_seconds
    for micro in range(accum):
        with profiler.section("data_wait"):
            batch = data.loader.next_batch()  # with its anchors (anchors.AnchorDraw)
            if data.caches.follows:
                # every rank holds its batch before the step's collectives: a peer waiting for a part
                # that may never come would hold this rank in the gradient all-reduce, where no
                # signal is seen; this wait is checked (distributed.wait_for_peers)
                barrier(info)
        # The noise comes from a generator seeded by this batch's place in the run, as its anchors.
        noise = noise_generator(cfg.optimization.seed, data.loader.epoch, data.loader.last_index, info.device)
        with profiler.section("host_to_device"):
            batch = dequantize_batch({k: v.to(info.device, non_blocking=True) for k, v in batch.items()})
        with gradient_sync(run.model, micro == accum - 1):  # all-reduce only with the last micro-batch
            with profiler.section("forward"), run.autocast:
                out = compute_loss(run.loss_model, batch, cfg.objective, noise_generator=noise,
                                   progress=step / run.total_steps)
            with profiler.section("backward"):
                (out.loss / accum).backward()
        run.metrics.update(out, batch)
    with profiler.section("optimizer"):
        grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optimization.grad_clip or math.inf)
        optimizer.step()
        run.state.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    run.metrics.add_step(grad_norm, data.loader.wait_seconds - wait_before, step + 1)


def log_train_metrics(run: Run) -> dict[str, float]:
    """Reduce the training metrics since the last log over ranks, log them, and stop the run if
    they went nan (the guard); returns them."""
    step, data, heldout = run.state.step, run.data, run.state.heldout
    last = run.metrics.compute(run.info)
    last.update(lr=run.state.scheduler.get_last_lr()[0], epoch=data.loader.epoch,
                gpu_mem_gib=gpu_memory_gib(run.info.device))
    heldout.add_train(last)
    following = follow_fields(data)  # --follow: parts extracted and trained, data wait
    run.log.log(step, "train", {**heldout.train_fields(), **last, **following})
    run.log.advance(0, **heldout.progress_fields(), train_tau=last["tau"], loss=last["loss"],
                    tok_s=last["context_tokens_per_second"], **following)
    run.guard.check(step, last)
    tell(run.log, run.loader_watch.observe(step, last["data_wait"]))
    run.metrics.reset()
    return last


def evaluate_heldout(run: Run) -> bool:
    """The held-out estimate of this step (when the run has held-out samples); whether it is the
    best so far, whose checkpoint is then written and kept whatever --keep-checkpoints says."""
    metrics = evaluate(run.loss_model, run.data, run.cfg.objective, run.autocast, run.cfg, run.info)
    if metrics is None:
        return False
    run.eval_metrics = metrics
    heldout, step = run.state.heldout, run.state.step
    run.log.log(step, "eval", heldout.observe(step, metrics))
    run.checkpoints.checkpoints.best_step = heldout.best_step
    return heldout.best_step == step


def stop_waiting(run: Run, stop: StopRequest, position: dict[str, Any]) -> TrainResult:
    """A stop that came while the run waited for data another process makes (--follow: a part not
    extracted yet) or for a peer rank at an agreement point, which may never come: the step in progress is abandoned (the loader goes back
    to `position`, its start) and the last completed step is saved, unless it is already (or none
    is: nothing to save). Under several ranks the save is collective and the others may be inside
    the step: this rank exits with its last checkpoint, and the launcher ends them."""
    loader = run.data.loader
    loader.close()  # its workers stop waiting too (they see the stop: runtime.signals.check_stop)
    loader.load_state_dict(position)
    if run.state.step and run.info.world_size == 1:
        run.checkpoints.save_unless_saved()
    run.log.info(f"stopped at step {run.state.step} while waiting for data or a peer rank; rerun the same command "
                 "to resume.")
    return run.result(stop.exit_status or 130)


def finish_run(run: Run) -> TrainResult:
    """The last checkpoint and the export: RUN_DIR/final is the best held-out checkpoint's weights
    (the last step's when none is better); the last step's stay in checkpoints/."""
    step, heldout = run.state.step, run.state.heldout
    run.guard.check(step)  # neither a checkpoint nor final/ of nan weights
    last_checkpoint = run.checkpoints.save_unless_saved()
    best = heldout.best_step if heldout.best_step not in (None, step) else None
    target = training_target({"identity": run.state.identity, "config": run.cfg.to_dict(), "step": step,
                              "heldout": heldout.summary(step)}, exported_step=best if best is not None else step)
    final_dir = export_final(run.model, run.state.optimizer, run.drafter, run.run_dir / FINAL_DIR, run.info, run.log,
                             best=run.checkpoints.checkpoints.dir / step_dir_name(best) if best is not None else None,
                             training_target=target)
    run.log.info(heldout.final_message(step, final_dir, last_checkpoint, caveat=run.data.heldout_caveat(),
                                       cut_short=run.length.done_text()))
    return run.result(0, final_dir)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def refuse_nothing_to_learn(data: TrainingData, block_size: int) -> None:
    """A run whose training samples are all too short for one block (a block starts at a token
    and predicts the next: 2 tokens at least) would end with loss 0 and an untrained drafter."""
    if not len(data.train_indices) or data.caches.follows:  # (a followed cache grows)
        return
    longest = int(np.max(data.caches.lengths[data.train_indices]))
    if longest < 2:
        raise InputError(Finding("train.nothing-to-learn", samples=len(data.train_indices), longest=longest,
                                 block_size=block_size))


def load_target_config_or_fail(target_dir: str) -> Any:
    try:
        return load_target_config(target_dir)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise InputError(Finding("train.target-config-unreadable", target=str(target_dir), error=str(e))) from e


def drafter_line(c: Any) -> str:
    """The startup line that says which drafter a run trains (and how the engines will load it)."""
    shape = f"{c.num_hidden_layers} layer(s), block {c.block_size}, target layers {list(c.target_layer_ids)}"
    return f"drafter: {get_head(c.drafter_type).describe(c, shape)}"


def build_drafter(cfg: TrainConfig, data: TrainingData, announce: Callable[[str], None] | None = None,
                  resume_from: Path | None = None) -> DFlashDrafter:
    """A fresh drafter (seeded) with the target's frozen tensors; layers from the cache. Its weights
    come from --init-drafter, unless the run resumes (`resume_from`: that checkpoint's win)."""
    manifest = data.caches.manifest
    soft_weight = cfg.objective.soft_label_weight or 0.0
    if soft_weight > 0 and not (manifest.store_last_hidden or manifest.topk):
        raise TrainConfigError(Finding("train.soft-labels-not-in-cache", weight=soft_weight,
                                       cache=str(manifest.cache_dir)))
    torch.manual_seed(cfg.optimization.seed)
    try:
        drafter = DFlashDrafter.from_target(
            cfg.model.target_model, with_final_norm=soft_weight > 0 and not manifest.topk,
            target_layer_ids=manifest.target_layer_ids, announce=announce, **cfg.model.drafter_overrides())
    except (FileNotFoundError, ValueError) as e:
        raise InputError(Finding("train.drafter-unbuildable", target=str(cfg.model.target_model), error=str(e))) from e
    if announce is not None:
        announce(drafter_line(drafter.config))
    if cfg.model.init_drafter:
        warm_start(drafter, cfg.model.init_drafter, cfg.model.target_model, announce, resume_from=resume_from)
    if cfg.runtime.gradient_checkpointing:
        for layer in drafter.layers:
            layer.forward = functools.partial(recompute, layer.forward, use_reentrant=False)
    on_cuda = str(cfg.runtime.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cfg.runtime.compile or (cfg.runtime.compile is None and on_cuda):  # None: compiled on CUDA
        # One graph for the whole forward; FSDP's hooks and recomputed layers keep one per layer.
        drafter.compile_training(cfg.runtime.compile_mode, per_layer=cfg.runtime.parallel == "fsdp" or cfg.runtime.gradient_checkpointing,
                                 dynamic=cfg.runtime.compile_dynamic)
        if announce is not None:
            announce("compiling the training forward: the first steps and new batch shapes take longer "
                     "(docs/train.md, Throughput); --no-compile trains eager")
    return drafter


def build_optimizer(cfg: TrainConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.optimization.lr, betas=cfg.optimization.adam_betas, eps=cfg.optimization.adam_eps,
                             weight_decay=cfg.optimization.weight_decay, fused=device.type == "cuda")


def lr_multiplier(step: int, *, total_steps: int, warmup_ratio: float, min_lr_ratio: float,
                  schedule: str = "cosine", decay_ratio: float = 0.2) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine from 1 to min_lr_ratio, or
    (wsd) 1 until the last decay_ratio of the steps and a linear decay to min_lr_ratio there."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = max(1, math.ceil(decay_ratio * total_steps))
        progress = min(1.0, max(0.0, (step - (total_steps - decay)) / decay))
        return 1 - (1 - min_lr_ratio) * progress
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_context(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast (float32 master weights) or nothing; the context is reusable."""
    if dtype == "bf16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    if enabled:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@torch.no_grad()
def refuse_foreign_final(final: Path, info: DistInfo) -> None:
    """Before training: RUN_DIR/final is replaced by the run's export at its end, so it must be
    empty, absent or an earlier export; anything else is refused now, not after the training
    (rank 0 looks; every rank stops)."""
    refusal = None
    if info.is_main:
        try:
            export_out_dir(final, purpose="run-final")
        except InputError as e:
            refusal = e
    if any_rank(int(refusal is not None), info):
        raise refusal or InputError(Finding("train.final-dir-foreign", final=str(final)))


def export_final(model: nn.Module, optimizer: torch.optim.Optimizer, drafter: DFlashDrafter, out_dir: Path,
                 info: DistInfo, log: RunLogger, *, best: Path | None = None,
                 training_target: dict[str, Any] | None = None) -> Path | None:
    """Export the drafter as it is now or, given `best`, the weights of that checkpoint (rank 0
    reads it; if it is gone, every rank falls back to the current weights, and the log says so)."""
    if best is not None and any_rank(int(info.is_main and not (best / MODEL_FILE).is_file()), info):
        tell(log, Finding("train.best-checkpoint-gone", checkpoint=str(best)))
        best = None
    if best is not None:
        path = None
        if info.is_main:
            path = export_from_state(unwrap(drafter).config, load_file(str(best / MODEL_FILE)), out_dir,
                                     training_target=training_target)
        barrier(info)
        return path
    model_state, _ = full_state(model, optimizer, info, with_optimizer=False)
    path = (export_from_state(unwrap(drafter).config, model_state, out_dir, training_target=training_target)
            if info.is_main else None)
    barrier(info)
    return path

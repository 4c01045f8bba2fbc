"""The training loop: `train(config)` reads top to bottom; each piece it wires lives in its own module.

data (loader.py) -> drafter (model.py) -> loss (objective.py) -> optimizer/schedule (here)
-> held-out estimate (evaluation.py) -> metrics and logs (reporting.py) -> checkpoints
(checkpoint.py), over any number of processes (distributed.py), stopped cleanly by SIGINT/SIGTERM
(signals.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.runtime.errors import InputError
from dflash.runtime.locks import WriterLock
from dflash.runtime.signals import StopRequest, StopWaiting
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from .attention import refuse_backend_off_its_device
from .checkpoint import (
    MODEL_FILE,
    Checkpointer,
    capture_rng,
    export_from_state,
    step_dir_name,
    training_target,
)
from .config import DivergedError, OptimizationConfig, TrainConfig, TrainConfigError
from .data import TrainingData, check_cache_target, open_training_data
from .distributed import (
    DistInfo,
    any_rank,
    barrier,
    full_state,
    init_distributed,
    unwrap,
    wrap_model,
)
from .evaluation import LossModel, evaluate
from .export import export_out_dir
from .follow import follow_fields, report_consumption
from .heads import get_head
from .loader import dequantize_batch
from .memory import fit_to_device
from .model import DFlashDrafter
from .objective import (
    compute_loss,
    label_summary,
    sample_anchors,
    scored_slots,
    stores_target_top1,
)
from .reporting import HeldoutTracker, RunLogger, RunningMetrics, StepProfiler, gpu_memory_gib
from .resume import resume, run_identity
from .run_length import RunLength
from .target_weights import load_target_config
from .warm_start import warm_start


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
    info = init_distributed(cfg.runtime.device)
    run_dir = Path(cfg.logging.output_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # One run per directory: a second would delete the first's checkpoints and mix its logs.
        cleanup.enter_context(WriterLock(
            run_dir / RUN_LOCK_FILE, what=f"the run directory {run_dir}",
            fix="Two runs cannot share an --output-dir: wait for that run to finish or stop it, or "
                "choose another --output-dir."))
    refuse_foreign_final(run_dir / FINAL_DIR, info)
    log = RunLogger(run_dir, enabled=info.is_main, progress=cfg.logging.progress, tensorboard=cfg.logging.tensorboard)
    seed_everything(cfg.optimization.seed)

    # Data: manifests only. Every epoch's batch list is planned here, before any part is read.
    data = open_training_data(cfg, rank=info.rank, world_size=info.world_size,
                              pin_memory=info.device.type == "cuda")
    cleanup.callback(data.loader.close)  # however the run ends, its loader workers end with it
    manifest = data.caches.manifest
    cfg = cfg.with_soft_labels(bool(manifest.store_last_hidden or manifest.topk)).with_hard_label(
        stores_target_top1(manifest))
    target_config = load_target_config_or_fail(cfg.model.target_model)
    for note in check_cache_target(data.caches.manifest, target_config, cfg.model.target_model,
                                   caches=data.caches):
        log.info(f"Note: {note}")
    log.info(data.summary() + label_summary(cfg.objective, manifest))
    length = RunLength.of(data.loader.steps_per_epoch, cfg.optimization.max_steps)  # --epochs, or --max-steps
    if note := length.startup_note(cfg, heldout=bool(data.heldout_count)):
        log.info(f"Note: {note}")
    if info.is_main and data.heldout_count and (note := data.unlike_heldout_note(cfg.model.block_size)):
        log.info(f"Note: {note}")
    refuse_nothing_to_learn(data, cfg.model.block_size)
    refuse_backend_off_its_device(cfg.model.attention_backend, info.device)
    # CUDA: the largest micro-batch must fit the device (the head's chunks shrink to fit, or a refusal
    # names a setting that fits), before the first step runs out of memory
    cfg = fit_to_device(cfg, target_config, data, info.device, log.info, world_size=info.world_size)

    # Model: the drafter's own weights plus the target's frozen embedding and lm_head (or, resumed,
    # the latest checkpoint's, loaded below: an --init-drafter is then not loaded).
    checkpoints = Checkpointer(run_dir, keep_checkpoints=cfg.logging.keep_checkpoints)
    drafter = build_drafter(cfg, data, announce=log.info, resume_from=checkpoints.latest()).to(info.device)
    model = wrap_model(drafter, cfg.runtime.parallel, info)
    optimizer = build_optimizer(cfg, model, info.device)
    total_steps = length.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, total_steps=total_steps, warmup_ratio=cfg.optimization.warmup_ratio, min_lr_ratio=cfg.optimization.min_lr_ratio,
        schedule=cfg.optimization.lr_schedule, decay_ratio=cfg.optimization.decay_ratio))
    objective, autocast = cfg.objective, autocast_context(cfg.runtime.dtype, info.device)
    loss_model = LossModel(model, drafter)
    # Anchors are drawn where each batch is read (a loader worker), off the training thread.
    data.loader.prepare = functools.partial(draw_anchors, seed=cfg.optimization.seed, max_anchors=objective.max_anchors,
                                            block_size=drafter.config.block_size)

    # Resume from the latest complete checkpoint when there is one and it is this run's.
    identity = run_identity(cfg, data, drafter, target_config, info)
    heldout = HeldoutTracker()  # best held-out evaluation so far: part of every checkpoint
    step = resume(cfg, checkpoints, identity, model, optimizer, scheduler, data, log, heldout)
    if info.is_main:
        checkpoints.remove_stale()

    def save(step: int) -> Path | None:
        # Full (gathered) state; collective under FSDP, so every rank calls it. Rank 0 writes.
        model_state, optim_state = full_state(model, optimizer, info)
        path = None
        if info.is_main:
            trainer_state = {"scheduler": scheduler.state_dict(), "loader": data.loader.state_dict(),
                             "rng": capture_rng(), "heldout": heldout.state_dict()}
            meta = {"epoch": data.loader.epoch, "loader": data.loader.state_dict(), "identity": identity,
                    "config": cfg.to_dict(), "drafter_config": dataclasses.asdict(drafter.config),
                    "world_size": info.world_size, "heldout": heldout.summary(step)}
            path = checkpoints.save(step, model_state, optim_state, trainer_state, meta)
            log.info(f"checkpoint: {path}")
        barrier(info)
        report_consumption(data, info.rank, info.world_size)  # --follow: what a disk budget may evict
        return path

    def stop_waiting(step: int, position: dict[str, Any]) -> TrainResult:
        # A stop that came while the run waited for data another process makes (--follow: a part not
        # extracted yet), which may never come: the step in progress is abandoned (the loader goes
        # back to `position`, its start) and the last completed step is saved, unless it is already
        # (or none is: nothing to save). Under several ranks the save is collective and the others
        # may be inside the step: this rank exits with its last checkpoint, and the launcher ends them.
        nonlocal last_checkpoint
        data.loader.close()  # its workers stop waiting too (they see the stop: runtime.signals.check_stop)
        data.loader.load_state_dict(position)
        if step and saved_step != step and info.world_size == 1:
            refuse_nonfinite(step)
            last_checkpoint = save(step)
        log.info(f"stopped at step {step} while waiting for data; rerun the same command to resume.")
        log.close()
        return TrainResult(step, stop.exit_status or 130, last_checkpoint, None, last, eval_metrics, heldout.best_step)

    metrics = RunningMetrics(drafter.config.block_size, info.device)

    def refuse_nonfinite(step: int, last: dict[str, float] | None = None) -> None:
        # Given `last` (a log's metrics, reduced over ranks: the same on every rank), its loss and
        # gradient norm decide; else (before a checkpoint or the export) the device's note of a
        # non-finite step and the weights themselves, agreed over ranks. No bf16 loss scaler skips a
        # step here: one nan gradient makes AdamW's moments, then every weight, nan.
        if last is not None:
            if all(math.isfinite(last[k]) for k in ("loss", "grad_norm")):
                return
            bad = int(metrics.first_nonfinite.item()) or step
        else:
            bad = metrics.nonfinite_step(info)
            if not bad and not any_rank(int(not weights_finite(model)), info):
                return
        log.close()
        raise DivergedError(diverged_message(bad or step, cfg, last, checkpoints.latest(), run_dir / "final"))
    profiler = StepProfiler(cfg.logging.profile_interval, info.device)
    # saved_step: the step of the newest checkpoint (the one resumed from, or none yet: -1)
    last, saved_step, last_checkpoint, eval_metrics = {}, (step if step else -1), checkpoints.latest(), None
    eval_every = cfg.logging.eval_every(total_steps)
    log.start(total_steps, step)
    with StopRequest(finishing="finishing this step, writing a checkpoint, then exiting",
                     abandoning="exiting now without a checkpoint") as stop:
        while step < total_steps:
            profiler.begin(step)
            model.train()
            wait_before, position = data.loader.wait_seconds, data.loader.state_dict()
            for micro in range(cfg.optimization.grad_accum):
                with profiler.section("data_wait"):
                    try:
                        batch = data.loader.next_batch()
                    except StopWaiting:
                        return stop_waiting(step, position)
                # Anchors and noise come from a generator seeded by this batch's place in the run:
                # no stream state to carry over a resume, and the same draws on any world size.
                generators = batch_generators(cfg.optimization.seed, data.loader.epoch, data.loader.last_index, info.device)
                with profiler.section("host_to_device"):  # the batch holds its anchors (draw_anchors)
                    batch = dequantize_batch({k: v.to(info.device, non_blocking=True) for k, v in batch.items()})
                last_micro = micro == cfg.optimization.grad_accum - 1
                with gradient_sync(model, last_micro):  # all-reduce only with the last micro-batch
                    with profiler.section("forward"), autocast:
                        out = compute_loss(loss_model, batch, objective, generator=generators[0],
                                           noise_generator=generators[1], progress=step / total_steps)
                    with profiler.section("backward"):
                        (out.loss / cfg.optimization.grad_accum).backward()
                metrics.update(out, batch)
            with profiler.section("optimizer"):
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.optimization.grad_clip or math.inf)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            metrics.add_step(grad_norm, data.loader.wait_seconds - wait_before, step + 1)
            step += 1
            log.advance(1)
            if (report := profiler.report()) is not None:
                log.info(f"[step {step}] {report}")

            eval_due = (eval_every and step % eval_every == 0) or step == total_steps
            if step % cfg.logging.log_interval == 0 or step == total_steps or eval_due:
                last = metrics.compute(info)  # CPU-GPU sync point: only every log_interval steps
                last.update(lr=scheduler.get_last_lr()[0], epoch=data.loader.epoch,
                            gpu_mem_gib=gpu_memory_gib(info.device))
                heldout.add_train(last)
                following = follow_fields(data)  # --follow: parts extracted and trained, data wait
                log.log(step, "train", {**heldout.train_fields(), **last, **following})
                log.advance(0, **heldout.progress_fields(), train_tau=last["tau"], loss=last["loss"],
                            tok_s=last["context_tokens_per_second"], **following)
                refuse_nonfinite(step, last)
                metrics.reset()
            new_best = False
            try:
                eval_metrics = evaluate(loss_model, data, objective, autocast, cfg, info) if eval_due else eval_metrics
            except StopWaiting:  # (--follow: held-out samples of parts not extracted yet)
                return stop_waiting(step, data.loader.state_dict())
            if eval_due and eval_metrics is not None:
                log.log(step, "eval", heldout.observe(step, eval_metrics))
                new_best = heldout.best_step == step
                checkpoints.best_step = heldout.best_step  # kept from now on, whatever keep_checkpoints says
            # A signal on any rank stops every rank after the same step (agreed on the CPU).
            stopping = any_rank(stop.signum, info)
            if (cfg.logging.save_interval and step % cfg.logging.save_interval == 0) or stopping or new_best:
                refuse_nonfinite(step)  # never a checkpoint of nan weights
                last_checkpoint, saved_step = save(step), step
            if stopping:
                log.info(f"stopped at step {step}; rerun the same command to resume.")
                log.close()
                return TrainResult(step, stop.exit_status or 130, last_checkpoint, None, last, eval_metrics,
                                   heldout.best_step)

    refuse_nonfinite(step)  # neither a checkpoint nor final/ of nan weights
    if saved_step != step:
        last_checkpoint = save(step)
    # RUN_DIR/final is the best held-out checkpoint; the last step's stays in checkpoints/.
    best = heldout.best_step if heldout.best_step not in (None, step) else None
    final_dir = export_final(model, optimizer, drafter, run_dir / FINAL_DIR, info, log,
                             best=checkpoints.dir / step_dir_name(best) if best is not None else None,
                             training_target=training_target({
                                 "identity": identity, "config": cfg.to_dict(), "step": step,
                                 "heldout": heldout.summary(step)}, exported_step=best if best is not None else step))
    log.info(heldout.final_message(step, final_dir, last_checkpoint, caveat=data.heldout_caveat(),
                                   cut_short=length.done_text()))
    log.close()
    return TrainResult(step, 0, last_checkpoint, final_dir, last, eval_metrics, heldout.best_step)


# -- the pieces train() wires -------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def refuse_nothing_to_learn(data: TrainingData, block_size: int) -> None:
    """A run whose training samples are all too short for one block (a block starts at a token
    and predicts the next: 2 tokens at least) would end with loss 0 and an untrained drafter."""
    lengths = getattr(data.caches, "lengths", None)
    if lengths is None or not len(data.train_indices) or data.config.follow:  # (a followed cache grows)
        return
    longest = int(np.max(np.asarray(lengths)[data.train_indices]))
    if longest < 2:
        raise InputError(
            f"Nothing to learn: every one of the {len(data.train_indices)} training samples is {longest} token "
            f"long, and a block (--block-size {block_size}) starts at a token of the completion and predicts the "
            "next, so a sample needs 2 tokens at least. Extract the full completions (check the data's "
            "input_ids and --max-seq-len of dflash-extract) and train on that cache."
        )


@torch.no_grad()
def weights_finite(model: nn.Module) -> bool:
    """Whether every trainable weight (this rank's shard under FSDP) is finite (a host sync)."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
             for p in model.parameters() if p.requires_grad]
    return bool(torch.stack(flags).all()) if flags else True


def diverged_message(step: int, cfg: TrainConfig, last: dict[str, float] | None, checkpoint: Path | None,
                     final_dir: Path) -> str:
    """What a run whose loss went nan or inf says as it stops (DivergedError)."""
    lr = cfg.optimization.lr
    seen = f" (logged: loss={last['loss']:.4g}, grad_norm={last['grad_norm']:.4g})" if last else ""
    kept = (f"the last checkpoint, {checkpoint}, is from before it and is kept" if checkpoint is not None
            else "no checkpoint was written before it")
    final = (f"{final_dir} is as it was" if (final_dir / "config.json").is_file()
             else f"nothing was exported to {final_dir}")
    return (f"The loss diverged at step {step}: the training loss or gradient norm became nan or inf{seen}, and "
            "from there every weight of the drafter turns nan. The run stopped without checkpointing or exporting "
            f"those weights: {kept}; {final}. Rerun with a lower --lr (this run's is {lr:g}; the default is "
            f"{OptimizationConfig.lr:g}): in a new --output-dir to start over"
            + (", or the same command with the lower --lr to resume from that checkpoint (one written shortly "
               "before the divergence may hold weights already far off)" if checkpoint is not None else "")
            + (". A --grad-clip (0 turns clipping off) and a longer --warmup-ratio also steady the first steps"
               if cfg.optimization.grad_clip == 0 else ". A longer --warmup-ratio also steadies the first steps")
            + ".")


def load_target_config_or_fail(target_dir: str) -> Any:
    try:
        return load_target_config(target_dir)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise InputError(f"Cannot read the target model's config: {e}") from e


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
        raise TrainConfigError(
            f"--soft-label-weight {soft_weight} needs soft labels in the cache, but "
            f"{manifest.cache_dir} stores neither last_hidden nor top-k log-probs. Extract with "
            "--store-last-hidden or --store-topk, or set --soft-label-weight 0."
        )
    torch.manual_seed(cfg.optimization.seed)
    try:
        drafter = DFlashDrafter.from_target(
            cfg.model.target_model, with_final_norm=soft_weight > 0 and not manifest.topk,
            target_layer_ids=manifest.target_layer_ids, announce=announce, **cfg.model.drafter_overrides())
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"Cannot build the drafter from {cfg.model.target_model}: {e}") from e
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
            announce("compiling the training forward: the first steps, and a few later ones whose batch "
                     "shapes are new to it, take longer (about 4 minutes in all for bench/quality's drafter "
                     "on a fresh H200 host, 30 s when torch.compile's cache, TORCHINDUCTOR_CACHE_DIR, "
                     "holds an earlier run of the same drafter); --no-compile trains eager")
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


def add_anchors(batch: dict, max_anchors: int, block_size: int, generator: torch.Generator) -> None:
    """Put the batch's anchors and its scored block slots (both worked out on the host, so
    the step never waits for the GPU) into it; the DataLoader pins them with the batch."""
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], max_anchors, generator)
    slots = scored_slots(batch["input_ids"], batch["loss_mask"], batch["lengths"], anchors, valid, block_size)
    batch.update(anchor_positions=anchors, anchor_valid=valid, scored_slots=slots)


def draw_anchors(batch: dict, epoch: int, batch_index: int, *, seed: int, max_anchors: int,
                 block_size: int) -> None:
    """`add_anchors` with the anchor generator of global batch `batch_index` of `epoch`: the
    same draws wherever it runs (a loader worker, or the trainer's own process)."""
    add_anchors(batch, max_anchors, block_size, torch.Generator().manual_seed(batch_seeds(seed, epoch, batch_index)[0]))


def batch_seeds(seed: int, epoch: int, batch_index: int) -> tuple[int, int]:
    """(anchor seed, noise seed) of one global training batch."""
    # The 0 once told training batches from held-out ones (evaluation now draws no anchors);
    # it stays so that the same run gets the same draws as before.
    entropy = [seed, 0, epoch, batch_index]
    anchor_seed, noise_seed = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint64)
    return int(anchor_seed), int(noise_seed)


def batch_generators(seed: int, epoch: int, batch_index: int,
                     device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """(anchor generator on the CPU, noise generator on `device`) of one global training batch."""
    anchor_seed, noise_seed = batch_seeds(seed, epoch, batch_index)
    anchors = torch.Generator().manual_seed(anchor_seed)
    noise = torch.Generator(device=device).manual_seed(noise_seed)
    return anchors, noise


@torch.no_grad()
def refuse_foreign_final(final: Path, info: DistInfo) -> None:
    """Before training: RUN_DIR/final is replaced by the run's export at its end, so it must be
    empty, absent or an earlier export; anything else is refused now, not after the training
    (rank 0 looks; every rank stops)."""
    refusal = None
    if info.is_main:
        try:
            export_out_dir(final, what="The run's export directory",
                           fix="Move those files out of it, or choose another --output-dir.")
        except InputError as e:
            refusal = e
    if any_rank(int(refusal is not None), info):
        raise refusal or InputError(f"The run's export directory {final} holds files that are not a drafter "
                                    "export (rank 0 says which): move them out of it, or choose another "
                                    "--output-dir.")


def export_final(model: nn.Module, optimizer: torch.optim.Optimizer, drafter: DFlashDrafter, out_dir: Path,
                 info: DistInfo, log: RunLogger, *, best: Path | None = None,
                 training_target: dict[str, Any] | None = None) -> Path | None:
    """Export the drafter as it is now or, given `best`, the weights of that checkpoint (rank 0
    reads it; if it is gone, every rank falls back to the current weights, and the log says so)."""
    if best is not None and any_rank(int(info.is_main and not (best / MODEL_FILE).is_file()), info):
        log.info(f"warning: the best held-out checkpoint {best} is gone; exporting the last step's "
                 "weights instead.")
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

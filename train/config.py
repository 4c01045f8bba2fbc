"""Settings of one training run: every `dflash-train` flag, its config-file key and its field here
share one name. `TrainConfig` is made of sections, one per component, each declared once: `data`
(the caches, the split and the batches: what the loader reads), `model` (the drafter's settings;
`DrafterSettings` is the part a drafter records in its own `DrafterConfig`), `objective` (how
blocks are drawn and scored: `ObjectiveConfig`, what the loss reads), `optimization`, `runtime`
and `logging`. Flags and config-file keys stay flat (`--lr`, `lr`, not `optimization.lr`), and so
does `to_dict()`, the settings a checkpoint records. A setting that decides the batches or the
drafter's shape says so where it is declared (`setting(identity=...)`): the run identity a resumed
run must share with its checkpoint is built from those marks (`resume.run_identity`); every other
setting may change on resume. Importing this module does not import torch: `dflash-train --help`
builds its flags from it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import click
from dflash.runtime.devices import DTYPE_ALIASES, DtypeChoice
from dflash.runtime.errors import DflashError, MismatchError, UsageError
from dflash.runtime.findings import Finding
from dflash.runtime.settings import (
    Identity,
    build_settings,
    compose,
    flat_values,
    read_settings_file,
    section,
    setting,
    settings_of,
)
from dflash.train.heads import get_head, head_names, settings_parts
from dflash.train.heads.base import HeadSettingError
from dflash.train.heads.limits import below, flag, not_finite, out_of_range
from dflash.train.model.layer_types import parse_layer_types

DTYPES = ("auto", "bf16", "fp32")  # the runtime's dtype names (dflash.runtime.devices) training supports
PARALLEL_MODES = ("ddp", "fsdp")
NOISE_TYPES = ("none", "uniform", "gaussian")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")  # the kernels of train/model/attention.py (it imports them from here)
LOSS_WEIGHTINGS = ("decay", "acceptance")
HARD_LABELS = ("sample", "target")
LR_SCHEDULES = ("cosine", "wsd")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's (model.py checks them)
DRAFTER_TYPES = head_names()  # the heads registered when this module was imported (train/heads/)


class HeadChoice(click.Choice):
    """--drafter-type's choices: the heads registered when it is read (`heads.head_names()`), so that a
    head registered after this module was imported (tests/toy_head.py) is a choice of the flag and the
    config key too."""

    def __init__(self) -> None:
        super().__init__(head_names())

    @property
    def choices(self) -> tuple[str, ...]:
        return head_names()

    @choices.setter
    def choices(self, value: Any) -> None:  # (click.Choice sets them once: they are the registry's)
        pass


class TrainConfigError(UsageError):
    """A setting of `dflash-train` is missing, unknown, out of range or inconsistent."""


class DivergedError(TrainConfigError):
    """The training loss or gradient norm became nan or inf: a setting (most often --lr) too
    large for the run."""


class ResumeMismatchError(MismatchError):
    """A run directory holds checkpoints of a run with other data, target or model shape, or of
    a version of dflash-train that wrote another layout."""


def _check_choices(obj: Any, choices: dict[str, tuple[str, ...]]) -> None:
    for name, allowed in choices.items():
        if getattr(obj, name) not in allowed:
            raise TrainConfigError(Finding("train.setting-choice", flag=flag(name), value=getattr(obj, name),
                                           choices=list(allowed)))


def _check_at_least(obj: Any, names: tuple[str, ...], low: int) -> None:
    if (found := below(obj, names, low)) is not None:
        raise TrainConfigError(found)


def _check_finite(obj: Any, names: tuple[str, ...]) -> None:
    """Refuse nan and inf, which the range checks let through (any comparison with nan is false)."""
    if (found := not_finite(obj, names)) is not None:
        raise TrainConfigError(found)


def _check_range(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise TrainConfigError(out_of_range(name, value, allowed))


# -- data -------------------------------------------------------------------------------------


@section
@dataclass(kw_only=True)
class DataConfig:
    """The caches, the held-out split and how samples become micro-batches (what the loader reads)."""

    cache: list[str] = field(default_factory=list)
    """Hidden-state cache directory (repeat for several caches of the same target and layers)."""
    eval_cache: list[str] = field(default_factory=list)
    """Held-out cache(s) for evaluation; when given, no training sample is held out (--eval-fraction is unused)."""
    eval_fraction: float = setting(0.02, identity=Identity(source="held_out_fraction"))
    """Fraction of the training caches' samples held out for evaluation, chosen by a hash of each sample id (stable as caches grow; 0: no held-out split)."""
    eval_max_samples: int = 2000
    """Evaluate on at most this many held-out samples, the same ones every time (0: all)."""
    eval_max_batches: int = 0
    """Evaluate on at most this many held-out batches per rank (0: all)."""
    max_train_samples: int = setting(0, identity=Identity(omit_default=True))
    """Train on at most this many of the training samples (0: all), chosen by a hash of each sample
    id: a larger cap keeps every sample of a smaller one (for a learning curve: how tau grows with data)."""
    token_budget: int = setting(16384, identity="batching")
    """Padded tokens per micro-batch (batch size x longest sample)."""
    max_batch_size: int = setting(64, identity="batching")
    """Most samples per micro-batch."""
    max_seq_len: int = setting(8192, identity="batching")
    """Longer samples are truncated to this many tokens (counted and reported at startup)."""
    shuffle_window: int = setting(8192, identity="batching")
    """Samples sorted by length together before batching (larger: less padding, less randomness)."""
    shuffle_parts: int = setting(0, identity=Identity("batching", omit_default=True))
    """0: shuffle each epoch over the whole data; N: plan each epoch group by group, N consecutive
    parts of the extraction at a time (what --follow and a disk budget need: training then trails
    the extraction and needs at most a group's parts at once)."""
    follow: bool = False
    """Train on a cache dflash-extract is still filling: wait for each part as it is needed, until
    every part of the extraction's plan is committed (one --cache; weights as on the finished cache)."""
    allow_incomplete: bool = False
    """Train on the committed parts of a cache whose extraction has not finished (stopped, or one
    of its ranks lost): without it such a cache is refused, since its samples are a part of the data."""
    disk_budget: str | int | None = setting(None, metavar="SIZE")
    """Local disk the run may fill with cache parts (e.g. 500G, 2T; plus at most one part): an s3://
    cache's staging directory stays within it (per remote cache); with --follow, the budget the
    extraction was given with its own --disk-budget, which checks that what the run reads at once
    fits it (default: no budget). It changes where bytes live, never the batches: a run resumes
    with another budget."""
    staging_dir: str | None = setting(None, metavar="DIR")
    """Directory under which an s3:// cache is staged, one subdirectory per URL (default:
    ~/.cache/dflash/staging; a resumed run finds what it fetched there)."""
    num_workers: int | None = None
    """DataLoader worker processes reading and decoding the cache (0: in the main process); by default
    one fewer than the CPU cores each process of the run may use, at most 4."""
    prefetch_factor: int = 4
    """Micro-batches each worker prepares ahead."""
    verify_checksums: bool = True
    """Check every chunk's crc32c while reading (turn off only for a trusted cache)."""

    def __post_init__(self) -> None:
        if isinstance(self.cache, str):
            self.cache = [self.cache]
        if isinstance(self.eval_cache, str):
            self.eval_cache = [self.eval_cache]
        self.cache, self.eval_cache = [str(c) for c in self.cache], [str(c) for c in self.eval_cache]
        if not self.cache:
            raise TrainConfigError(Finding("train.setting-required", flag="--cache"))
        _check_at_least(self, ("token_budget", "max_batch_size", "max_seq_len", "shuffle_window",
                               "prefetch_factor"), 1)
        if self.num_workers is None:
            self.num_workers = default_num_workers()
        _check_at_least(self, ("num_workers", "eval_max_samples", "eval_max_batches", "max_train_samples",
                               "shuffle_parts"), 0)
        _check_finite(self, ("eval_fraction",))
        _check_range("eval_fraction", self.eval_fraction, 0.0 <= self.eval_fraction < 1.0, "in [0, 1)")
        self._check_disk_settings()

    @property
    def held_out_fraction(self) -> float:
        """The fraction of the training caches held out: --eval-fraction, or 0 with --eval-cache."""
        return 0.0 if self.eval_cache else self.eval_fraction

    def disk_budget_bytes(self) -> int | None:
        """--disk-budget in bytes (None: no budget)."""
        from dflash.cache_tools.staging import parse_size  # (no torch)

        return None if self.disk_budget is None else parse_size(self.disk_budget)

    def _check_disk_settings(self) -> None:
        remote = any(c.startswith("s3://") for c in (*self.cache, *self.eval_cache))
        if self.staging_dir is not None and not remote:
            raise TrainConfigError(Finding("train.staging-dir-unused", value=self.staging_dir))
        if self.disk_budget is None:
            return
        self.disk_budget = str(self.disk_budget)
        try:
            budget = self.disk_budget_bytes()
        except DflashError:
            budget = None
        if budget is None or budget < 1:
            raise TrainConfigError(Finding("train.disk-budget-size", value=self.disk_budget))
        if not (remote or self.follow):
            raise TrainConfigError(Finding("train.disk-budget-local", value=self.disk_budget))
        if not self.follow:
            return
        if self.shuffle_parts == 0:
            raise TrainConfigError(Finding("train.follow-budget-shuffle-parts", value=self.disk_budget))
        if not self.eval_cache and self.eval_fraction > 0:
            raise TrainConfigError(Finding("train.follow-budget-held-out", value=self.disk_budget,
                                           eval_fraction=self.eval_fraction))


# -- model ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class BackboneSettings:
    """The settings of the drafter's backbone a run chooses and a drafter records (every head's)."""

    block_size: int = setting(16, identity="model")
    """Tokens per drafted block: the anchor plus block_size-1 predictions."""
    mask_token_id: int | None = setting(None, identity="model")
    """Embedding row used for masked block positions (default: the tokenizer's mask token, else an
    unused or reserved row; the choice is kept in checkpoints and the export)."""
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    """sdpa (dense mask), flex (block-sparse, compiled on CUDA) or auto."""
    drafter_type: str = setting("dflash2", type=HeadChoice())
    """dflash2 (the default): DFlash plus an in-block convolution around every sublayer and a
    candidate selector over the target head's top-K, served by vLLM and SGLang as DFlash2DraftModel;
    or dflash, the plain DFlash drafter (DFlashDraftModel), which trains about 1.2x faster
    (docs/drafter.md, docs/recipe.md: on the BPE benchmark DFlash2 gains 4 % on code at 4,096
    completions and 17 % at 32,768, and is level on prose)."""


DrafterSettings = compose(
    "DrafterSettings", (BackboneSettings, *settings_parts("settings")), module=__name__, error=HeadSettingError,
    doc="""The drafter's settings a run chooses and a drafter records: the backbone's, then each
    registered head's (`DraftHead.settings`, declared in the head's module; their ranges are checked
    wherever these settings are built). `DrafterConfig` is a `DrafterSettings` too, with the
    target's dimensions and the resolved layer attention.""")


@section
@dataclass(kw_only=True)
class ModelConfig(DrafterSettings):
    """The target and the drafter's shape (the rest of the drafter's dimensions are the target's)."""

    settings_error = TrainConfigError  # (a head's setting out of range: a usage error of the run)

    target_model: str = ""
    """Target model directory: only its config.json, embedding and lm_head are read."""
    num_draft_layers: int = setting(5, identity=Identity("model", source="num_hidden_layers"))
    """Decoder layers of the drafter."""
    draft_layer_types: str = setting("full", identity=Identity("model", key="layer_types"))
    """Attention of the draft layers: full, sliding, or one per layer (e.g. sliding,sliding,full)."""
    draft_sliding_window: int | None = setting(None, identity=Identity("model", key="sliding_window"))
    """Window of the sliding draft layers in tokens (required with sliding layers)."""
    draft_causal: bool | None = setting(None, identity=Identity("model", key="causal"))
    """Block tokens see only earlier block tokens (default: causal for sliding layers, bidirectional
    for full ones, as vLLM and SGLang serve them)."""
    init_drafter: str | None = None
    """Warm start: an exported drafter directory (dflash-train export, or a released DFlash / DFlash2
    drafter of this target) whose weights this run starts from instead of a random init, e.g. to
    fine-tune a drafter of a related run on this data. Its shape must be this run's (draft layers,
    block size, target layers, drafter type; a DFlash2 run may start from a DFlash drafter, whose
    predictions it then starts from); a run that resumes from its own checkpoint ignores it."""

    def __post_init__(self) -> None:
        if not self.target_model:
            raise TrainConfigError(Finding("train.setting-required", flag="--target-model"))
        super().__post_init__()  # the heads' settings' ranges
        _check_at_least(self, ("num_draft_layers",), 1)
        _check_range("block_size", self.block_size, self.block_size >= 2, "at least 2")
        _check_choices(self, {"attention_backend": ATTENTION_BACKENDS, "drafter_type": head_names()})
        try:
            types = parse_layer_types(self.draft_layer_types, self.num_draft_layers)
        except ValueError as e:
            raise TrainConfigError(getattr(e, "finding", None) or f"--draft-layer-types: {e}") from e
        if "sliding_attention" in types and (self.draft_sliding_window or 0) < 1:
            raise TrainConfigError(Finding("train.sliding-needs-window", value=self.draft_layer_types))

    def drafter_overrides(self) -> dict[str, Any]:
        """DrafterConfig fields set by this run (the rest come from the target's config)."""
        out: dict[str, Any] = {"num_hidden_layers": self.num_draft_layers, "block_size": self.block_size,
                               "attention_backend": self.attention_backend}
        if self.mask_token_id is not None:
            out["mask_token_id"] = self.mask_token_id
        out.update(layer_types=self.draft_layer_types, sliding_window=self.draft_sliding_window,
                   causal=self.draft_causal)
        out["drafter_type"] = self.drafter_type
        out.update({name: getattr(self, name) for name in get_head(self.drafter_type).setting_names})
        return out


# -- objective --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class BackboneObjective:
    """How blocks are drawn and the backbone's slots scored (every head's)."""

    max_anchors: int = 512
    """Most anchors (blocks) drawn per sequence, redrawn every epoch."""
    loss_weighting: str = setting("acceptance", choices=LOSS_WEIGHTINGS)
    """Per-slot loss weights: acceptance (the drafter's own detached probability of reaching
    slot k: the product of its probabilities of the earlier slots' labels, a confidence-derived
    weighting in the manner of D-PACE; on the quality benchmark tau 5.01 vs 4.56 for decay) or
    decay (exp(-(k-1)/gamma), the paper's). With a vocabulary of 65K ids or more, compare both:
    on the demo's short run at 65,536 ids decay was ahead (4.79 vs 4.49; docs/recipe.md)."""
    gamma: float | None = None
    """Decay of the per-position loss weights under --loss-weighting decay (default: 7/5/4 for blocks of 16/10/8)."""
    noise_type: str = setting("none", choices=NOISE_TYPES)
    """Noise on the cached hidden states: none, uniform U(-a, a) or gaussian N(0, a^2)."""
    noise_start: float = 0.0
    """Noise amplitude a at the start of training."""
    noise_end: float | None = None
    """Noise amplitude at the end of training (linear in between; default: noise_start)."""
    soft_label_weight: float | None = None
    """Weight w of KL to the target's distribution, loss = (1 - w) CE + w KL (needs top-k log-probs or
    last_hidden in the cache). Default: 0.5 where the cache stores them (dflash-extract stores the top-8
    by default), else 0. On the BPE benchmark at 4,096 completions and 10 epochs 0.5 gave +3.9 % tau on
    code and +3.0 % on prose (docs/recipe.md)."""
    hard_label: str | None = setting(None, choices=HARD_LABELS)
    """The token each block slot's cross-entropy (and a DFlash2 selector's) trains toward: the
    sample's next token (sample), or the target's own top-1 after the sample's tokens (target), what
    greedy verification accepts, read from the cache's top-k (dflash-extract stores the top-8 by
    default) or its top-1. The two differ on sampled completions wherever the sample left the
    target's greedy choice; the acceptance weights and the training tau follow the label. A sample
    whose cache holds neither (outside a --top1-share) trains on its own tokens. Default: target for
    a DFlash2 drafter (the default --drafter-type) where the cache stores the target's top-k or top-1 (on the BPE benchmark
    at 4,096 completions +5.0 % tau on code, level on prose), else sample (for DFlash the two were
    level on both domains; docs/recipe.md)."""
    logits_chunk_mib: int = 8192
    """The most MiB of float32 logits the target head's cross-entropy holds at once: a micro-batch
    whose scored block slots need more runs the head over chunks of 1 GiB (many short samples score
    150K slots: at 152K ids, 90 GiB of logits, over 200 GiB with the backward). All at once is
    faster where it fits (one 3,072-token sample at the 8B shape, 4.4 GiB: 4.6 % a step, for 9.7
    GiB more memory). 0: no limit."""

    def __post_init__(self) -> None:
        _check_finite(self, ("gamma", "noise_start", "noise_end", "soft_label_weight"))
        _check_at_least(self, ("max_anchors",), 1)
        _check_at_least(self, ("logits_chunk_mib",), 0)
        _check_choices(self, {"loss_weighting": LOSS_WEIGHTINGS, "noise_type": NOISE_TYPES})
        if self.hard_label is not None:  # None: decided by the drafter type and the cache (TrainConfig.with_hard_label)
            _check_choices(self, {"hard_label": HARD_LABELS})
        if self.gamma is not None:
            _check_range("gamma", self.gamma, self.gamma > 0, "more than 0")
        if self.gamma is not None and self.loss_weighting != "decay":
            raise TrainConfigError(Finding("train.gamma-without-decay", gamma=self.gamma,
                                           loss_weighting=self.loss_weighting))
        _check_range("noise_start", self.noise_start, self.noise_start >= 0, "0 or more")
        if self.noise_end is not None:
            _check_range("noise_end", self.noise_end, self.noise_end >= 0, "0 or more")
        if self.soft_label_weight is not None:
            _check_range("soft_label_weight", self.soft_label_weight, 0.0 <= self.soft_label_weight <= 1.0,
                         "in [0, 1]")

    def noise_amplitude(self, progress: float) -> float:
        """Amplitude at training progress in [0, 1] (clamped), linear from start to end."""
        end = self.noise_start if self.noise_end is None else self.noise_end
        t = min(max(float(progress), 0.0), 1.0)
        return self.noise_start + (end - self.noise_start) * t


ObjectiveConfig = section(compose(
    "ObjectiveConfig", (BackboneObjective, *settings_parts("objective_settings")), module=__name__,
    error=TrainConfigError, doc="""How blocks are drawn and scored (what `objective.compute_loss` reads): the
    backbone's settings, then each registered head's loss settings (`DraftHead.objective_settings`)."""))


# -- optimization -----------------------------------------------------------------------------


DEFAULT_SOFT_LABEL_WEIGHT = 0.5
"""--soft-label-weight when it is left out and the cache stores soft labels."""


@section
@dataclass(kw_only=True)
class OptimizationConfig:
    """AdamW, the learning-rate schedule, the steps and the seed."""

    lr: float = 6e-4
    """Peak learning rate of AdamW."""
    lr_schedule: str = setting("wsd", choices=LR_SCHEDULES)
    """After the warmup: wsd (warmup-stable-decay: lr held, then a linear decay to lr * min_lr_ratio
    over the last --decay-ratio of the steps; on the quality benchmark tau 4.60 vs cosine's 3.52 at
    one epoch, docs/recipe.md) or cosine (from lr down to lr * min_lr_ratio)."""
    decay_ratio: float = 0.2
    """wsd: fraction of the optimizer steps spent in the final decay."""
    min_lr_ratio: float = 0.0
    """The schedule ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.04
    """Fraction of the optimizer steps spent in linear warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    # the identity records the batches of a step across ranks (resume.run_identity gives the world size)
    grad_accum: int = setting(1, identity=Identity("batching", key="batches_per_step (world_size x grad_accum)"))
    """Micro-batches per optimizer step on each rank."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: off)."""
    epochs: int = 10
    """Passes over the training samples. 10 against 6 on the BPE benchmark at 4,096 completions: +7.5 %
    tau on code, -1.3 % on prose; with the default soft labels +11.6 % and +1.6 % (docs/recipe.md)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run all epochs); the schedule spans them."""
    seed: int = setting(0, identity="batching")
    """Seed of the model init, the per-epoch shuffle and every batch's anchors and noise."""

    def __post_init__(self) -> None:
        self.adam_betas = tuple(float(b) for b in self.adam_betas)  # type: ignore[assignment]
        _check_finite(self, ("lr", "weight_decay", "adam_betas", "adam_eps", "grad_clip", "decay_ratio", "min_lr_ratio",
                             "warmup_ratio"))
        _check_at_least(self, ("grad_accum", "epochs"), 1)
        _check_at_least(self, ("max_steps", "weight_decay", "grad_clip", "seed"), 0)
        _check_choices(self, {"lr_schedule": LR_SCHEDULES})
        _check_range("warmup_ratio", self.warmup_ratio, 0.0 <= self.warmup_ratio < 1.0, "in [0, 1)")
        _check_range("min_lr_ratio", self.min_lr_ratio, 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]")
        if not 0.0 <= self.decay_ratio <= 1.0 or self.warmup_ratio + self.decay_ratio > 1.0:
            raise TrainConfigError(Finding("train.decay-ratio", decay_ratio=self.decay_ratio,
                                           warmup_ratio=self.warmup_ratio))
        _check_range("lr", self.lr, self.lr > 0, "more than 0")
        _check_range("adam_betas", self.adam_betas,
                     len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "two numbers in [0, 1)")


# -- runtime ----------------------------------------------------------------------------------


@section
@dataclass(kw_only=True)
class RuntimeConfig:
    """Where and how the steps run: device, dtype, compilation, parallelism."""

    dtype: str = setting("auto", type=DtypeChoice(DTYPES))
    """bf16 (autocast, float32 master weights), fp32, or auto (bf16 on CUDA, fp32 on CPU)."""
    compile: bool | None = None
    """torch.compile the drafter's training forward; by default on CUDA and not elsewhere (it
    fuses the elementwise work, the bulk of a small drafter's step; docs/BENCHMARKS.md)."""
    compile_mode: str = setting("default", choices=COMPILE_MODES)
    """torch.compile mode under --compile: default, reduce-overhead (also CUDA graphs, one per batch shape), max-autotune-no-cudagraphs or max-autotune."""
    compile_dynamic: bool = False
    """Under --compile, every input size symbolic from the first compile (torch.compile's dynamic=True): batches
    of varying shapes compile once instead of once per size that starts to vary (not yet measured on a GPU)."""
    gradient_checkpointing: bool = False
    """Recompute each draft layer in the backward pass (less memory; each layer's forward runs twice)."""
    memory_check: bool = True
    """Before the first step, estimate the GPU memory of the run's largest micro-batch (from the
    samples' lengths): lower --logits-chunk-mib where the head's logits at once do not fit, refuse
    with the setting to change where nothing else does (docs/train.md, "Long samples")."""
    parallel: str = setting("ddp", choices=PARALLEL_MODES)
    """With several processes: ddp (replicated drafter) or fsdp (FSDP2, sharded drafter)."""
    device: str | None = None
    """Torch device (default: this rank's CUDA device, else cpu)."""

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # bfloat16 -> bf16, ...
        _check_choices(self, {"dtype": DTYPES, "compile_mode": COMPILE_MODES, "parallel": PARALLEL_MODES})


# -- logging, evaluation, checkpoints ---------------------------------------------------------


@section
@dataclass(kw_only=True)
class LoggingConfig:
    """The run directory: metrics, evaluations, checkpoints."""

    output_dir: str = ""
    """Run directory: checkpoints/, metrics.jsonl, final/ (the exported drafter)."""
    log_interval: int = 10
    """Optimizer steps between metric logs (console, metrics.jsonl, TensorBoard)."""
    eval_interval: int | None = None
    """Optimizer steps between evaluations on the held-out split (default: 10 per run; 0: only at the end)."""
    profile_interval: int = 0
    """Print a wall-time breakdown of a step every N steps (0: off; env DFLASH_PROFILE_INTERVAL)."""
    progress: bool = True
    """Show a progress bar (on rank 0, when the output is a terminal)."""
    tensorboard: bool = True
    """Also log to RUN_DIR/tensorboard when the tensorboard package is installed."""
    save_interval: int = 1000
    """Optimizer steps between checkpoints (0: only at the end and on a signal)."""
    keep_checkpoints: int = 3
    """Most recent checkpoints kept in RUN_DIR/checkpoints (older ones are deleted, except the best held-out one)."""
    resume: bool = False
    """Require a checkpoint to resume from (without it, a run resumes when one exists)."""

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise TrainConfigError(Finding("train.setting-required", flag="--output-dir"))
        _check_at_least(self, ("log_interval", "keep_checkpoints"), 1)
        _check_at_least(self, ("eval_interval", "save_interval", "profile_interval"), 0)
        if self.profile_interval == 0 and os.environ.get("DFLASH_PROFILE_INTERVAL"):
            try:
                self.profile_interval = int(os.environ["DFLASH_PROFILE_INTERVAL"])
            except ValueError:
                raise TrainConfigError(Finding("train.profile-interval-env",
                                               value=os.environ["DFLASH_PROFILE_INTERVAL"])) from None

    def eval_every(self, total_steps: int) -> int:
        """Steps between evaluations: --eval-interval, or 10 evaluations per run by default."""
        if self.eval_interval is not None:
            return self.eval_interval
        return max(1, math.ceil(total_steps / 10))


# -- the run ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `dflash-train` needs, by section; each setting's name is its flag's and its key's."""

    data: DataConfig
    model: ModelConfig
    objective: ObjectiveConfig
    optimization: OptimizationConfig
    runtime: RuntimeConfig
    logging: LoggingConfig

    def to_dict(self) -> dict[str, Any]:
        """{setting: value}, flat (the settings a checkpoint records; the shape of a config file)."""
        out = flat_values(self)
        out["adam_betas"] = list(self.optimization.adam_betas)
        return out

    def with_soft_labels(self, cache_has_soft_labels: bool) -> TrainConfig:
        """This config with --soft-label-weight decided: as given, else DEFAULT_SOFT_LABEL_WEIGHT where
        the cache stores soft labels and 0 where it does not (the run records the decided weight)."""
        if self.objective.soft_label_weight is not None:
            return self
        weight = DEFAULT_SOFT_LABEL_WEIGHT if cache_has_soft_labels else 0.0
        return replace(self, objective=replace(self.objective, soft_label_weight=weight))

    def with_hard_label(self, cache_has_top1: bool) -> TrainConfig:
        """This config with --hard-label decided: as given, else the drafter head's default (target
        for DFlash2) where the cache stores the target's top-k or top-1, and sample otherwise (the
        run records it)."""
        if self.objective.hard_label is not None:
            return self
        label = get_head(self.model.drafter_type).default_hard_label if cache_has_top1 else "sample"
        return replace(self, objective=replace(self.objective, hard_label=label))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """A TrainConfig from flat {setting: value} (`to_dict`'s shape); unknown names refused."""
        unknown = sorted(set(values) - set(settings_of(cls)))
        if unknown:
            raise TrainConfigError(Finding("train.unknown-settings", unknown=unknown, known=list(CONFIG_KEYS)))
        return build_settings(cls, values, error=TrainConfigError)


CONFIG_KEYS = tuple(settings_of(TrainConfig))
"""Every setting of a run, flat: its flags' names, its config-file keys, `to_dict()`'s keys."""


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """{setting: value} of a JSON or YAML config file, each converted and checked as its flag's
    value would be (dflash.runtime.settings); unknown keys are errors."""
    return read_settings_file(settings_of(TrainConfig), path, error=TrainConfigError)


def make_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> TrainConfig:
    """TrainConfig from a config file's values with flag values on top (flags win; None or an
    empty list: the flag was not given)."""
    values = {**file_values}
    values.update({k: v for k, v in overrides.items() if v is not None and not (isinstance(v, (list, tuple)) and not v)})
    return build_settings(TrainConfig, values, error=TrainConfigError)


def default_num_workers(cap: int = 4) -> int:
    """Loader workers a process of this run takes by default: one fewer than the CPU cores it may
    use (its share of the host under torchrun), at most `cap` (more workers than cores only
    contend; torch warns of it)."""
    return max(0, min(cap, process_cores() - 1))


def process_cores() -> int:
    """The CPU cores a process of this run may use: its affinity's, shared by the processes of one
    host under torchrun (LOCAL_WORLD_SIZE)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))

"""The GPU memory of a training step, estimated before the first one (docs/train.md, "Long samples").

What a step holds at its peak, the moment the target head's loss is computed (every draft layer's
activations are still held for the backward, the head's logits and their gradient are live):

- state: the drafter's float32 weights and AdamW's two moments, 12 bytes a trainable parameter
  (the gradients, 4 more, are made while the activations are freed: counted where larger),
  the target's frozen embedding and lm_head in bf16, and their bf16 copies autocast makes;
- the micro-batch: its captured target states, T x K x D bf16 per sample;
- context activations: per context token, the fused context and each draft layer's keys and values;
- block activations: per block token (anchors x block size) and draft layer, the attention's and
  the MLP's saved tensors (a head's wrappers add some); with --gradient-checkpointing only
  each layer's input is kept, and one layer's activations are rebuilt at a time;
- the head: N = anchors x (block size - 1) scored slots over V ids, all at once or, past
  --logits-chunk-mib, one chunk of rows at a time, plus an [N, D] gradient; a logit costs what the
  head loss's path holds of it (LOGIT_BYTES);
- what the drafter's head adds (`DraftHead.memory`, a `HeadMemory`): its parameters, its wrappers'
  activations per block token and layer, its loss's per slot and per logit (DFlash2: the bf16
  logits kept for its candidates, 2 bytes a logit at once; its convolutions, 4 bytes a block token,
  layer and channel, measured); DSpark's, XPress's and LiLiCorr's figures are rough, from their shapes;
- the attention mask: nothing for flex full layers (tile counts), a dense [Q, T + Q] bool per
  sample for sdpa, and, built before the forward, every (query, key) entry of the mask_mod for flex
  sliding or causal layers (`attention.build_attention_mask` through create_block_mask).

The per-token figures were measured on the CPU as the bytes of the tensors autograd saves
(tests/test_train_memory.py repeats the measurement at a small shape); under torch.compile the
activations are scaled by COMPILED_ACTIVATIONS, fitted to the step memory measured on one H100/H200
at the 8B shape (docs/BENCHMARKS.md). The worst micro-batch of a run is bounded from the samples'
lengths: every token counted as a completion token, so each sample brings min(--max-anchors, its
length - 1) anchors.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from dflash.runtime.findings import Finding
from dflash.train.config import DrafterSettings, TrainConfig, TrainConfigError
from dflash.train.heads import get_head
from dflash.train.heads.base import HeadMemory

if TYPE_CHECKING:
    from dflash.train.data.caches import TrainingData

GIB = 2**30
MIB = 2**20
COMPILED_ACTIVATIONS = 0.7
"""Activations saved by the compiled forward against the eager one (fitted: the 8B shape's
35.2 GiB measured with the head all at once, 25.6 GiB in chunks, 42.5 GiB for DFlash2)."""
RUNTIME_RESERVE = int(1.5 * GIB)
"""cuBLAS/compile workspaces and what the allocator cannot hand out (fragmentation)."""
USABLE_FRACTION = 0.92
"""The share of the device's free memory an estimate may fill (the rest absorbs its error)."""
CHUNK_MIB = 1024  # head_loss.CHUNK_MIB (head_loss imports torch; a test checks they agree)
LOGIT_BYTES = {"compiled": 4, "eager": 10, "target head": 18}
"""Bytes a logit of a chunk of the head's loss holds at its peak (train/loss/head_loss.py), by path:
compiled (a compiled drafter on CUDA, soft labels from the cache's top-k or none): the bf16 logits
and the bf16 gradient the compiled function writes; eager: those and one float32 copy turned in place
into the softmax and the gradient; target head (soft labels from the cache's last hidden states):
the eager path's float32 copy beside the target's own logits, their float32 log-probabilities and
probabilities. The eager paths' peaks measured on the CPU: 8 and 18 bytes a logit (the tensors the
ops return, tests/test_train_memory.py); compiled, the estimate lies 1.6-4.1 GiB above the step peaks
measured at the 8B, 27B and the quality benchmark's shapes (docs/BENCHMARKS.md)."""
MASK_BUILD_BYTES = 18
"""Bytes per (query, key) entry while a flex mask_mod is evaluated (a bool result and int64
intermediates of a few of its comparisons)."""


class MemoryBudgetError(TrainConfigError):
    """The largest micro-batch of the run would not fit the GPU's memory: the settings to change
    are named (the estimate, `train.memory`, docs/train.md "Long samples")."""


@dataclass(frozen=True)
class Dims:
    """The drafter's dimensions the estimate reads (`of` takes them from a DrafterConfig)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context_layers: int
    draft_layers: int
    block_size: int
    drafter_type: str = "dflash"
    settings: tuple[tuple[str, Any], ...] = ()
    """The head's settings (DrafterSettings fields, `DraftHead.setting_names`) as (name, value);
    those absent at their defaults."""
    layer_attention: tuple[tuple[int | None, bool], ...] = field(default=())
    """(window, causal) per draft layer; empty: every layer full and bidirectional."""

    @classmethod
    def of(cls, c: Any) -> Dims:
        return cls(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, intermediate=c.intermediate_size, vocab=c.vocab_size,
                   context_layers=len(c.target_layer_ids), draft_layers=c.num_hidden_layers,
                   block_size=c.block_size, drafter_type=c.drafter_type,
                   settings=tuple((n, getattr(c, n)) for n in get_head(c.drafter_type).setting_names),
                   layer_attention=tuple(c.layer_attention(i) for i in range(c.num_hidden_layers)))

    @property
    def head(self) -> HeadMemory:
        """What the drafter's head adds (`DraftHead.memory`), from these dimensions and its settings."""
        config = types.SimpleNamespace(**{
            **vars(DrafterSettings()), **dict(self.settings), "drafter_type": self.drafter_type,
            "block_size": self.block_size, "hidden_size": self.hidden, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "num_target_layers": self.context_layers, "num_hidden_layers": self.draft_layers})
        return get_head(self.drafter_type).memory(config)

    def trainable_params(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = 2 * d * q + 2 * d * kv + 3 * d * self.intermediate + 2 * d + 2 * self.head_dim
        return self.draft_layers * layer + self.context_layers * d * d + 2 * d + self.head.params

    def masked_layers(self) -> bool:
        """Whether a layer is sliding or causal (its flex mask is built from mask_mod entries)."""
        return any(w is not None or causal for w, causal in self.layer_attention)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the estimate sees it."""

    samples: int
    tokens: int
    """Padded length T: the longest sample's tokens."""
    anchors: int
    """Anchors of the whole micro-batch (each sample at most --max-anchors)."""

    def describe(self) -> str:
        return (f"{self.samples} sample(s) of {self.tokens:,} tokens with {self.anchors:,} anchors")


@dataclass(frozen=True)
class Estimate:
    """Bytes at the step's peak, by term (`terms` sum to `total`)."""

    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def largest(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)

    def describe(self) -> str:
        return ", ".join(f"{name} {value / GIB:.1f}" for name, value in self.terms.items() if value >= GIB / 20)


def head_bytes(dims: Dims, slots: int, logits_chunk_mib: int, path: str) -> int:
    """The target head's loss at its peak (head_loss.slot_losses): one chunk's logits at a time, all
    the slots while their float32 logits fit `logits_chunk_mib` (0: no limit), else chunks of
    CHUNK_MIB; a chunk holds LOGIT_BYTES[path] a logit, and the slots' gradient of the states."""
    v, d, head = dims.vocab, dims.hidden, dims.head
    own_rows, limit = slots * head.own_logit_rows, head.own_chunk_mib or logits_chunk_mib
    if limit > 0 and own_rows * v * 4 > limit * MIB:  # the head's own logits in chunks
        own_rows = min(own_rows, max(1, (CHUNK_MIB * MIB) // (4 * v)))
    own = own_rows * v * head.own_logit_bytes + slots * head.slot_bytes
    if logits_chunk_mib <= 0 or slots * v * 4 <= logits_chunk_mib * MIB:
        rows = slots
    else:
        rows = max(1, (min(CHUNK_MIB, logits_chunk_mib) * MIB) // (4 * v))
    return min(rows, slots) * v * LOGIT_BYTES[path] + slots * d * 8 + own


def estimate_step_memory(dims: Dims, batch: MicroBatch, *, backend: str = "flex", logits_chunk_mib: int = 8192,
                         gradient_checkpointing: bool = False, compiled: bool = True, world_size: int = 1,
                         parallel: str = "ddp", soft_from_hidden: bool = False) -> Estimate:
    """The bytes one training step of `batch` holds at its peak, by term (module docstring).
    `backend` is the resolved attention backend (sdpa or flex); `soft_from_hidden`: the soft labels
    come from the cache's last hidden states through the target's head."""
    d, i, kd = dims.hidden, dims.intermediate, dims.context_layers * dims.hidden
    q_width, kv_width = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    t, b, layers = batch.tokens, batch.samples, dims.draft_layers
    block_tokens = batch.anchors * dims.block_size
    params = dims.trainable_params()
    shard = world_size if parallel == "fsdp" and world_size > 1 else 1
    scale = COMPILED_ACTIVATIONS if compiled else 1.0

    per_block_layer = 8 * i + 30 * d + dims.head.layer_block_bytes + 12 * q_width + 16 * kv_width
    per_context_layer = 4 * d + 12 * kv_width
    context = b * t * (layers * per_context_layer + 2 * kd + 6 * d + 8 * dims.head_dim)
    if gradient_checkpointing:  # each layer's input kept (float32); one layer's activations rebuilt at a time
        blocks = block_tokens * (layers * 4 * d + per_block_layer * COMPILED_ACTIVATIONS + 4 * d
                                 + 8 * dims.head_dim)
    else:
        blocks = block_tokens * (layers * per_block_layer + 4 * d + 8 * dims.head_dim) * scale
    per_sample_block = block_tokens // max(b, 1)
    mask = 0
    if backend == "sdpa":  # the dense [Q, T + Q] mask of each sample, and the additive bias the kernel makes of it
        mask = b * per_sample_block * (t + per_sample_block) * 3
    terms = {
        "weights and AdamW": 12 * params // shard + (4 * params if world_size > 1 and parallel == "ddp" else 0),
        "target embedding and head": 2 * dims.vocab * d * 2,
        "bf16 weight copies": 2 * params // shard,
        "micro-batch": b * t * kd * 2,
        "context activations": int(context * scale),
        "block activations": int(blocks),
        "head": head_bytes(dims, batch.anchors * (dims.block_size - 1), logits_chunk_mib,
                           "target head" if soft_from_hidden else "compiled" if compiled else "eager"),
        "attention mask": mask,
        "runtime": RUNTIME_RESERVE,
    }
    # The gradients (4 bytes a parameter) appear while the layers' activations are freed: counted
    # where they outgrow the head's peak.
    terms["gradients"] = max(0, 4 * params // shard - terms["head"])
    if backend == "flex" and dims.masked_layers():
        # Built before the forward: only the state and the batch are held then.
        build = b * per_sample_block * (t + per_sample_block) * MASK_BUILD_BYTES  # create_block_mask: every entry
        held = sum(v for k, v in terms.items() if k not in ("context activations", "block activations", "head",
                                                             "gradients", "attention mask"))
        terms["attention mask"] = max(0, held + build - (sum(terms.values()) - terms["attention mask"]))
    return Estimate(terms)


def worst_micro_batches(lengths: Iterable[int], *, token_budget: int, max_batch_size: int,
                        max_anchors: int) -> list[MicroBatch]:
    """One bound per distinct sample length L (after truncation): the plan packs a batch from its
    longest sample L with at most min(--max-batch-size, --token-budget // L) samples of L tokens or
    fewer (plans.pack_batches), each with at most min(--max-anchors, L - 1) anchors."""
    out = []
    for length in sorted({int(x) for x in np.unique(np.asarray(list(lengths) if not isinstance(lengths, np.ndarray)
                                                                else lengths))}):
        if length < 2:
            continue
        samples = max(1, min(max_batch_size, token_budget // length))
        out.append(MicroBatch(samples=samples, tokens=length, anchors=samples * min(max_anchors, length - 1)))
    return out


@dataclass(frozen=True)
class MemoryPlan:
    """What the check decided: the run's config (with --logits-chunk-mib lowered where needed),
    the worst micro-batch, its estimate, and a notice for the log (None: nothing changed)."""

    config: TrainConfig
    batch: MicroBatch | None
    estimate: Estimate | None
    note: Finding | None = None


def _settings(cfg: TrainConfig, **changes: Any) -> dict[str, Any]:
    values = dict(token_budget=cfg.data.token_budget, max_batch_size=cfg.data.max_batch_size,
                  max_anchors=cfg.objective.max_anchors, logits_chunk_mib=cfg.objective.logits_chunk_mib,
                  gradient_checkpointing=cfg.runtime.gradient_checkpointing, max_seq_len=cfg.data.max_seq_len)
    values.update(changes)
    return values


def _worst(dims: Dims, lengths: np.ndarray, s: dict[str, Any], **kw: Any) -> tuple[MicroBatch, Estimate] | None:
    batches = worst_micro_batches(np.minimum(lengths, s["max_seq_len"]), token_budget=s["token_budget"],
                                  max_batch_size=s["max_batch_size"], max_anchors=s["max_anchors"])
    scored = [(b, estimate_step_memory(dims, b, logits_chunk_mib=s["logits_chunk_mib"],
                                       gradient_checkpointing=s["gradient_checkpointing"], **kw)) for b in batches]
    return max(scored, key=lambda x: x[1].total) if scored else None


def plan_step_memory(cfg: TrainConfig, dims: Dims, lengths: Sequence[int] | np.ndarray, free_bytes: int, *,
                     backend: str = "flex", compiled: bool = True, world_size: int = 1,
                     device_name: str = "the GPU", soft_from_hidden: bool = False) -> MemoryPlan:
    """Check that the run's largest micro-batch fits `free_bytes` (times USABLE_FRACTION); lower
    --logits-chunk-mib where the head's logits all at once are what does not fit; else raise
    MemoryBudgetError naming a setting and a value that fits."""
    lengths = np.asarray(lengths, dtype=np.int64)
    usable = int(free_bytes * USABLE_FRACTION)
    kw = dict(backend=backend, compiled=compiled, world_size=world_size, parallel=cfg.runtime.parallel,
              soft_from_hidden=soft_from_hidden)
    s = _settings(cfg)
    worst = _worst(dims, lengths, s, **kw)
    if worst is None:
        return MemoryPlan(cfg, None, None)
    batch, estimate = worst
    if estimate.total <= usable:
        return MemoryPlan(cfg, batch, estimate)
    # The head all at once is what a lower --logits-chunk-mib saves: the largest limit that fits.
    for limit in (4096, 2048, CHUNK_MIB, 512, 256):
        if limit >= s["logits_chunk_mib"] > 0:
            continue
        lowered = _worst(dims, lengths, _settings(cfg, logits_chunk_mib=limit), **kw)
        if lowered is not None and lowered[1].total <= usable:
            adapted = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, logits_chunk_mib=limit))
            note = Finding("train.logits-chunk-lowered", batch=dataclasses.asdict(lowered[0]),
                           needed_gib=estimate.total / GIB, was=s["logits_chunk_mib"], usable_gib=usable / GIB,
                           device=device_name, logits_chunk_mib=limit, lowered_gib=lowered[1].total / GIB)
            return MemoryPlan(adapted, lowered[0], lowered[1], note)
    raise MemoryBudgetError(refusal(cfg, dims, lengths, batch, estimate, usable, kw, device_name))


def _fits(dims: Dims, lengths: np.ndarray, s: dict[str, Any], usable: int, kw: dict[str, Any]) -> bool:
    worst = _worst(dims, lengths, s, **kw)
    return worst is None or worst[1].total <= usable


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest value in [low, high] for which `fits` (monotone: true below some value) holds."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def refusal(cfg: TrainConfig, dims: Dims, lengths: np.ndarray, batch: MicroBatch, estimate: Estimate,
            usable: int, kw: dict[str, Any], device_name: str) -> Finding:
    """What a run that does not fit is refused with: the worst micro-batch, its estimate and
    largest term, and settings (each a value that fits) that bring it under the device's memory."""
    s = _settings(cfg, logits_chunk_mib=CHUNK_MIB)
    fixes: dict[str, int | bool] = {}
    longest = int(np.minimum(lengths, s["max_seq_len"]).max())
    size = _largest_fitting(1, s["max_batch_size"] - 1, lambda n: _fits(dims, lengths, {**s, "max_batch_size": n},
                                                                          usable, kw))
    if size is not None:
        fixes["--max-batch-size"] = size
    anchors = _largest_fitting(16, s["max_anchors"] - 1, lambda a: _fits(dims, lengths, {**s, "max_anchors": a},
                                                                         usable, kw))
    if anchors is not None:
        fixes["--max-anchors"] = anchors
    if not s["gradient_checkpointing"] and _fits(dims, lengths, {**s, "gradient_checkpointing": True}, usable, kw):
        fixes["--gradient-checkpointing"] = True
    seq = _largest_fitting(512, longest - 1, lambda n: _fits(
        dims, lengths, {**s, "max_seq_len": n, "token_budget": min(s["token_budget"], max(n, s["token_budget"]))},
        usable, kw))
    if seq is not None:
        fixes["--max-seq-len"] = seq
    return Finding("train.memory-over-budget", batch=dataclasses.asdict(batch),
                   settings={"--token-budget": cfg.data.token_budget, "--max-batch-size": cfg.data.max_batch_size,
                             "--max-anchors": cfg.objective.max_anchors, "--max-seq-len": cfg.data.max_seq_len},
                   needed_gib=estimate.total / GIB, usable_gib=usable / GIB, device=device_name,
                   largest=estimate.largest(), largest_gib=estimate.terms[estimate.largest()] / GIB, fits=fixes)


def training_lengths(cfg: TrainConfig, data: TrainingData) -> np.ndarray:
    """The training samples' lengths; under --follow those known so far and one of --max-seq-len
    (parts still to come)."""
    known = np.asarray(data.caches.lengths)[np.asarray(data.train_indices, dtype=np.int64)]
    return np.append(known, cfg.data.max_seq_len) if cfg.data.follow else known


def soft_labels_from_hidden(cfg: TrainConfig, manifest: Any) -> bool:
    """Whether the run's soft labels come from the cache's last hidden states through the target's
    head (the objective takes the cache's top-k where it has one: loss/objective._soft_labels)."""
    return bool(cfg.objective.soft_label_weight and manifest.store_last_hidden and not manifest.topk)


def fit_to_device(cfg: TrainConfig, target_config: Any, data: TrainingData, device: Any,
                  announce: Callable[[Finding], None] | None = None, world_size: int = 1) -> TrainConfig:
    """The trainer's startup check, before the drafter is built: `cfg` as its largest micro-batch
    fits `device`'s free memory, --logits-chunk-mib lowered where needed (a notice to `announce`),
    or MemoryBudgetError. Nothing to check off CUDA or with --no-memory-check."""
    import torch
    from dflash.train.model.attention import resolve_backend
    from dflash.train.model.drafter_config import DrafterConfig

    device = torch.device(device)
    lengths = training_lengths(cfg, data)
    if device.type != "cuda" or not cfg.runtime.memory_check or not len(lengths):
        return cfg
    overrides = {**cfg.model.drafter_overrides(), "target_layer_ids": list(data.caches.manifest.target_layer_ids)}
    dims = Dims.of(DrafterConfig.from_target_config(target_config, **overrides))
    free, _total = torch.cuda.mem_get_info(device)
    compiled = cfg.runtime.compile if cfg.runtime.compile is not None else True
    plan = plan_step_memory(cfg, dims, lengths, free, backend=resolve_backend(cfg.model.attention_backend, device),
                            compiled=bool(compiled), world_size=world_size,
                            soft_from_hidden=soft_labels_from_hidden(cfg, data.caches.manifest),
                            device_name=f"{torch.cuda.get_device_name(device)} (free at startup)")
    if plan.note and announce is not None:
        announce(plan.note)
    return plan.config

"""Batches of cached samples for the trainer: length-bucketed, deterministic, resumable (what
the run trains on, opened, checked and split, is data.py's).

Startup reads the caches' manifests (every sample length is in the commit log) and, for the
held-out split (heldout.py), each part's sample ids. An epoch's batch list is a pure function
of (seed, epoch, the manifests, the batching settings): the samples are shuffled, sorted by
length inside windows of `shuffle_window` samples, packed greedily under the token budget, and
the batches shuffled again (plans.py). Rank r of W takes global batches
r, r+W, r+2W, ...; one optimizer step consumes W x grad_accum consecutive global batches, so a
run's batches do not depend on how they are spread over ranks. The position (epoch, global
batches consumed) is checkpointed; a resumed loader yields exactly the batches the
uninterrupted one would have. One DataLoader reads a rank's batches from that position to the
last epoch, so its workers read on across epoch boundaries.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from dflash.cache_tools.schema import (
    HIDDEN_ARRAYS,
    INPUT_IDS,
    LOSS_MASK,
    SAMPLE_IDS,
    TOP1_IDS,
    TOP1_KNOWN,
    TOPK_ARRAYS,
    scale_of,
)
from dflash.cache_tools.sources import SampleSource
from dflash.runtime.errors import CorruptDataError, DflashError
from dflash.runtime.findings import Finding
from dflash.train.config import DataConfig, ResumeMismatchError, TrainConfigError, process_cores
from dflash.train.data.codecs import device_decoder
from dflash.train.data.plans import check_budget, plan_epoch, plan_eval
from dflash.train.data.workers import decode_threads, worker_init

LOADER_STATE_VERSION = 1


# -- batch plans ------------------------------------------------------------------------------


# -- collation --------------------------------------------------------------------------------


def as_tensor(name: str, x: Any) -> torch.Tensor:
    """One array of a sample read from a cache (numpy) as a tensor, without a copy: a decoded
    hidden array's bf16 bits (uint16) as bfloat16."""
    if not isinstance(x, np.ndarray):
        return x
    if name in HIDDEN_ARRAYS and x.dtype == np.uint16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def sample_tensors(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample read from a cache (numpy arrays) as tensors, without copies (`as_tensor`)."""
    return {k: as_tensor(k, v) for k, v in sample.items()}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a (contiguous) tensor; bfloat16 as its bits (uint16), as a reader decodes."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def collate(samples: list[dict[str, Any]], padded: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples (numpy, as a cache reads them, or tensors) into the batch dict of
    `objective.compute_loss`.

    `padded` holds batch tensors already filled in place (see `read_batch`); they are used as
    they are instead of being assembled from the samples.
    """
    lengths = torch.tensor([s[INPUT_IDS].shape[0] for s in samples], dtype=torch.long)
    batch_size, seq_len = len(samples), int(lengths.max())
    out: dict[str, torch.Tensor] = {"lengths": lengths, **(padded or {})}
    for key in (*HIDDEN_ARRAYS, INPUT_IDS, LOSS_MASK, *TOPK_ARRAYS, TOP1_IDS):  # the part schema's per-token arrays
        if key not in samples[0] or key in out:
            continue
        first = as_tensor(key, samples[0][key])
        t = torch.empty((batch_size, seq_len, *first.shape[1:]), dtype=first.dtype)
        for b, s in enumerate(samples):
            n = s[key].shape[0]
            t[b, :n] = as_tensor(key, s[key])
            t[b, n:] = 0
        out[key] = t
    out[SAMPLE_IDS] = torch.tensor([s["sample_id"] for s in samples], dtype=torch.long)
    if TOP1_IDS in out:  # which rows' top1_ids hold the target's top-1 (a cache of --top1-share < 1: some)
        out[TOP1_KNOWN] = torch.tensor([bool(s.get(TOP1_KNOWN, True)) for s in samples])
    return out


STORED_CODEC = "stored_codec:"
"""A batch whose hidden arrays are still in a codec's stored form holds an empty tensor under
this prefix and the codec's name (a key, not a value: read without a device synchronisation)."""


def read_batch(caches: SampleSource, indices: Any) -> dict[str, torch.Tensor]:
    """Read samples and collate them, decoding hidden states straight into the padded batch.

    The hidden states are most of the bytes: decoding them in place saves a copy per sample
    and a fresh (page-faulting) buffer per sample. When every cache has one codec with a
    device decoder (fp8, nf4: dflash.train.data.codecs) the batch keeps the stored rows (and their
    scales), a quarter to a half of the bytes to move, and `dequantize_batch` decodes them
    on the training device.
    """
    indices = [int(j) for j in indices]
    lengths = [int(caches.lengths[j]) for j in indices]
    schema = caches.readers[0].schema
    names = {r.manifest.codec.name for r in caches.readers}
    stored = len(names) == 1 and device_decoder(next(iter(names))) is not None
    shape = (len(indices), max(lengths))
    padded = {}
    for spec in schema.hidden_arrays():
        if stored:
            padded[spec.name] = torch.from_numpy(np.empty((*shape, spec.width), dtype=spec.dtype))
            if scale_of(spec.name) in schema:
                padded[scale_of(spec.name)] = torch.empty((*shape, schema.scale_width(spec.name)), dtype=torch.float32)
        else:  # decoded to bf16 by the reader
            padded[spec.name] = torch.empty((*shape, schema.value_width(spec.name)), dtype=torch.bfloat16)
    samples = []
    for b, (j, n) in enumerate(zip(indices, lengths)):
        samples.append(caches.read(j, out={k: _as_numpy(v[b, :n]) for k, v in padded.items()}, dequantize=not stored))
        for v in padded.values():
            v[b, n:] = 0
    batch = collate(samples, padded)
    if stored:
        batch[STORED_CODEC + next(iter(names))] = torch.empty(0)
    return batch


def dequantize_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored hidden rows of `read_batch` (and their scales) -> bf16 rows, decoded by their
    codec's device decoder where the batch now lives (the GPU)."""
    marker = next((k for k in batch if k.startswith(STORED_CODEC)), None)
    if marker is None:
        return batch
    del batch[marker]
    decode = device_decoder(marker.removeprefix(STORED_CODEC))
    for name in HIDDEN_ARRAYS:
        if name in batch:
            batch[name] = decode(batch[name], batch.pop(scale_of(name), None))
    return batch


class WorkerReadError(CorruptDataError):
    """A DflashError met by a DataLoader worker reading a batch (a corrupt or missing chunk: the
    cache was opened and checked before), re-raised in the trainer.

    torch re-raises a worker's exception as `type(msg)` with the worker's whole traceback in
    `msg`; this class keeps only the original paragraph, so the CLI prints one clear paragraph,
    and the original finding (its code and fields, sent after the paragraph as JSON: `sent`).
    """

    _FINDING = "\x1ffinding:"

    def __init__(self, message: str | Finding):
        self._send = False
        if isinstance(message, str):
            marker = f"{type(self).__name__}: "
            message = message.rsplit(marker, 1)[-1].strip() if marker in message else message
            text, _, sent = message.partition(self._FINDING)
            try:
                code, fields = json.loads(sent)
                message = Finding(code, **fields)
            except (ValueError, TypeError):
                message = text
        super().__init__(message)

    @classmethod
    def sent(cls, error: DflashError) -> WorkerReadError:
        """`error` as a worker raises it: its finding travels in its text, as JSON data."""
        sent = cls(error.finding if error.finding is not None else str(error))
        sent._send = error.finding is not None
        return sent

    def __str__(self) -> str:
        text = super().__str__()
        if getattr(self, "_send", False):
            try:
                return text + self._FINDING + json.dumps([self.code, self.fields])
            except (TypeError, ValueError):  # (a field that is no JSON data: the paragraph alone)
                pass
        return text


class RankBatches:
    """A rank's batches from the loader's position to the end of its planned epochs, as one
    sequence: item k is global batch `index[k]` of epoch `epochs[k]`. Epoch plans are pure
    functions, so a worker makes the ones it reads from itself."""

    def __init__(self, loader: TrainLoader):
        last = max(loader.epoch, len(loader.steps_per_epoch) - 1)
        spans = [np.arange((loader.consumed if e == loader.epoch else 0) + loader.rank, loader.usable(e),
                           loader.world_size) for e in range(loader.epoch, last + 1)]
        self.epochs = np.concatenate([np.full(len(s), loader.epoch + i) for i, s in enumerate(spans)])
        self.index, self.last_epoch = np.concatenate(spans), last
        self._plan = functools.partial(plan_epoch, loader.indices, loader.caches.lengths, loader.config,
                                       groups=loader.groups, seed=loader.seed)
        self._cached = (loader.epoch, loader.epoch_batches(loader.epoch))

    def __len__(self) -> int:
        return len(self.index)

    def position(self, k: int) -> tuple[int, int]:
        return int(self.epochs[k]), int(self.index[k])

    def __getitem__(self, k: int) -> np.ndarray:
        epoch, index = self.position(k)
        if self._cached[0] != epoch:
            self._cached = (epoch, self._plan(epoch))
        return self._cached[1][index]


BatchPrepare = Callable[[dict[str, torch.Tensor], int, int], None]
"""Completes a training batch where it is read (in a DataLoader worker): called with the
batch, its epoch and its index in that epoch's global batch list."""


class _BatchList(torch.utils.data.Dataset):
    """Map-style dataset whose item i is the collated batch `batches[i]` (read in a worker),
    passed to `prepare(batch, i)` when given."""

    def __init__(self, caches: SampleSource, batches: Sequence[np.ndarray],
                 prepare: Callable[[dict[str, torch.Tensor], int], None] | None = None):
        self.caches, self.batches, self.prepare = caches, batches, prepare

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        try:
            # The training epoch it is read for (--follow refuses a part evicted for a later one).
            self.caches.reading_epoch = self.batches.position(i)[0] if isinstance(self.batches, RankBatches) else None
            batch = read_batch(self.caches, self.batches[i])
            if self.prepare is not None:
                self.prepare(batch, i)
            return batch
        except DflashError as e:
            if torch.utils.data.get_worker_info() is None:
                raise
            raise WorkerReadError.sent(e) from None


def data_loader(caches: SampleSource, batches: Sequence[np.ndarray], config: DataConfig,
                prepare: Callable[[dict[str, torch.Tensor], int], None] | None = None, *,
                pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader of `batches` (worker processes and prefetch of the data section;
    `pin_memory`: collate into pinned host memory, for asynchronous host-to-device copies)."""
    workers = config.num_workers if batches else 0
    return torch.utils.data.DataLoader(
        _BatchList(caches, batches, prepare), batch_size=None, shuffle=False, num_workers=workers,
        pin_memory=pin_memory,
        worker_init_fn=functools.partial(worker_init, trainer_pid=os.getpid(),
                                         threads=decode_threads(workers, process_cores())) if workers else None,
        prefetch_factor=config.prefetch_factor if workers else None,
        multiprocessing_context="fork" if workers else None,
        # Its iterator's seed comes from this generator, not the global RNG: a resumed run, which
        # starts one more iterator, keeps the global RNG streams of the uninterrupted run.
        generator=torch.Generator(),
    )


class TrainLoader:
    """This rank's micro-batches, epoch after epoch, from a resumable position."""

    def __init__(self, caches: SampleSource, indices: np.ndarray, config: DataConfig, *, seed: int, epochs: int,
                 rank: int = 0, world_size: int = 1, grad_accum: int = 1, prepare: BatchPrepare | None = None,
                 groups: np.ndarray | None = None, pin_memory: bool = False):
        self.caches, self.indices, self.config = caches, indices, config
        self.seed, self.pin_memory = seed, pin_memory  # the run's --seed shuffles each epoch's plan
        self.groups = groups  # each sample's plan group under --shuffle-parts (follow.part_groups)
        self.prepare = prepare
        """Run on every batch where it is read (the trainer's anchors: off its own thread)."""
        self.rank, self.world_size = rank, world_size
        self.batches_per_step = world_size * grad_accum
        check_budget(caches.lengths, indices, config)
        self._plans: dict[int, list[np.ndarray]] = {}
        # Packing depends on each window's samples, so an epoch's batch count can vary a little.
        self.steps_per_epoch = [len(self.epoch_batches(e)) // self.batches_per_step for e in range(epochs)]
        self._plans.clear()
        if min(self.steps_per_epoch) < 1:
            raise TrainConfigError(Finding("train.step-over-epoch", micro_batches=self.batches_per_step,
                                           world_size=world_size, grad_accum=grad_accum,
                                           epoch_batches=len(self.epoch_batches(0))))
        self.epoch, self.consumed = 0, 0  # consumed: global batches of this epoch already used
        self._iter: Iterator[dict[str, torch.Tensor]] | None = None
        self._iter_last_epoch = -1  # the last epoch the iterator's batch list reaches
        self.wait_seconds = 0.0
        self.last_index = -1

    @property
    def total_steps(self) -> int:
        return sum(self.steps_per_epoch)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._plans:
            self._plans = {epoch: plan_epoch(self.indices, self.caches.lengths, self.config, epoch, self.groups,
                                               seed=self.seed)}
        return self._plans[epoch]

    def state_dict(self) -> dict[str, Any]:
        return {"version": LOADER_STATE_VERSION, "epoch": self.epoch, "batches_consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise ResumeMismatchError(Finding("train.loader-state-version", version=state.get("version"),
                                              current=LOADER_STATE_VERSION))
        if state["batches_consumed"] % self.batches_per_step:
            raise ResumeMismatchError(Finding("train.resume-off-step-boundary", batches=state["batches_consumed"],
                                              micro_batches=self.batches_per_step))
        self.epoch, self.consumed = int(state["epoch"]), int(state["batches_consumed"])
        self._iter = None

    def usable(self, epoch: int) -> int:
        """Global batches of `epoch` that fill whole steps (the tail is dropped)."""
        return self.steps_per_epoch[min(epoch, len(self.steps_per_epoch) - 1)] * self.batches_per_step

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch of this rank (time spent waiting for it adds to wait_seconds)."""
        if self.consumed >= self.usable(self.epoch):
            self.epoch, self.consumed = self.epoch + 1, 0
        if self._iter is None or self.epoch > self._iter_last_epoch:
            # One iterator to the end of the planned epochs: its workers read on across epoch
            # boundaries instead of new ones starting cold at each (a stall per epoch).
            self.close()
            mine = RankBatches(self)
            prepare = None if self.prepare is None else functools.partial(_prepare_at, self.prepare, mine)
            self._iter, self._iter_last_epoch = iter(data_loader(self.caches, mine, self.config, prepare,
                                                pin_memory=self.pin_memory)), mine.last_epoch
        start = time.perf_counter()
        batch = next(self._iter)
        self.wait_seconds += time.perf_counter() - start
        self.last_index = self.consumed + self.rank  # its index in the epoch's global batch list
        self.consumed += self.world_size
        return batch

    def close(self) -> None:
        """Stop the worker processes now. Dropping the iterator is not enough after an error:
        the traceback still holds it, its workers live on, and at exit Python waits for them."""
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()


def _prepare_at(prepare: BatchPrepare, batches: RankBatches, batch: dict[str, torch.Tensor], k: int) -> None:
    """`prepare` of item k of a rank's batch list, with its epoch and global batch index."""
    prepare(batch, *batches.position(k))


SPLIT_KEYS = "split_keys"
"""An evaluation batch's split key per sample (CacheSet.split_keys: its record group's, else its
prompt's): the held-out interval resamples whole groups, whose samples are not independent."""


def eval_batches(caches: SampleSource, indices: np.ndarray, config: DataConfig, *, rank: int, world_size: int,
                 max_batches: int = 0, pin_memory: bool = False
                 ) -> tuple[torch.utils.data.DataLoader, int] | None:
    """A DataLoader over this rank's share of the held-out batches, and how many of its first
    batches are its own (None when there are none). Every rank runs the same number of batches
    (FSDP's forward is collective): a rank with fewer is given copies of others' to make up the
    count, which the evaluation runs and does not count, so every held-out batch is counted once
    on any number of ranks (`--eval-max-batches` caps each rank's own)."""
    if not len(indices):
        return None
    check_budget(caches.lengths, indices, config)
    batches = plan_eval(indices, caches.lengths, config)
    own = batches[rank::world_size]
    if max_batches:
        own = own[:max_batches]
    count = min(-(-len(batches) // world_size), max_batches or len(batches))
    padded = own + [batches[i % len(batches)] for i in range(count - len(own))]
    keys = caches.split_keys()

    def with_split_keys(batch: dict[str, torch.Tensor], i: int) -> None:
        batch[SPLIT_KEYS] = torch.from_numpy(keys[np.asarray(padded[i], dtype=np.int64)])

    return data_loader(caches, padded, config, with_split_keys, pin_memory=pin_memory), len(own)

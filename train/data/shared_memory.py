"""Whether the loader's batches in flight fit the host's shared memory. A DataLoader worker hands each
batch to the trainer through /dev/shm, and up to --num-workers x --prefetch-factor of them wait there
at once (twice that while a held-out evaluation's loader reads beside the training one's). A
container's /dev/shm is often small (Docker's default is 64 MB), and a worker that fills it dies of
SIGBUS partway through a run; long samples make every batch larger. At startup the run lowers
--prefetch-factor, then --num-workers, to what fits, and says so: the batches are the same whatever
the loader's workers (each batch's anchors are drawn from its place in the run)."""

from __future__ import annotations

from dflash.cache_tools.schema import PartSchema
from dflash.runtime.findings import Finding
from dflash.runtime.shared_memory import SHM_DIR, shm_free_bytes
from dflash.train.config import DataConfig

FILL = 0.8
"""The share of the free shared memory the batches in flight may take (the rest: other processes'
segments, and the copy a worker makes of the batch it hands over)."""


def token_bytes(schema: PartSchema) -> int:
    """A bound on the bytes a batch holds per padded token: the hidden arrays decoded to bf16 (an
    fp8 or nf4 batch carries fewer), every other per-token value as 8 bytes (collated ids are int64)."""
    hidden = {spec.name for spec in schema.hidden_arrays()}
    total = 0
    for spec in schema:
        if spec.per != "token":
            continue
        total += schema.value_width(spec.name) * 2 if spec.name in hidden else 8 * (spec.width or 1)
    return total


def fit_shared_memory(config: DataConfig, batch_bytes: int, loaders: int, free: int | None) -> Finding | None:
    """Lower `config`'s prefetch factor, then its workers, until loaders x workers x prefetch batches
    of `batch_bytes` fit FILL of `free` bytes (workers 0: the trainer's process reads, through no
    shared memory); the notice of what changed, or None."""
    workers, prefetch = config.num_workers, config.prefetch_factor
    if not workers or free is None or batch_bytes <= 0:
        return None
    fits = int(free * FILL) // (batch_bytes * max(1, loaders))  # batches in flight that fit
    if fits >= workers * prefetch:
        return None
    config.num_workers, config.prefetch_factor = (workers, fits // workers) if fits >= workers else (fits, 1)
    return Finding("train.shared-memory", path=SHM_DIR, free=int(free), batch_bytes=int(batch_bytes),
                   loaders=loaders, workers=workers, prefetch=prefetch, fit_workers=config.num_workers,
                   fit_prefetch=config.prefetch_factor)


def fit_loader_memory(config: DataConfig, data) -> Finding | None:
    """`fit_shared_memory` for a run's data: its batches bounded by --token-budget padded tokens, or
    by its longest sample where that is longer (--max-seq-len while the cache grows, --follow), two
    loaders where the run evaluates held-out samples."""
    lengths = data.caches.lengths
    longest = config.max_seq_len if config.follow or not len(lengths) else min(int(lengths.max()), config.max_seq_len)
    batch = max(config.token_budget, longest) * token_bytes(PartSchema.from_header(data.caches.manifest.header))
    return fit_shared_memory(config, batch, 2 if data.heldout_count else 1, shm_free_bytes())

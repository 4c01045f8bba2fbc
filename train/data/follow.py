"""Training on a cache that dflash-extract is still filling (`dflash-train --follow`).

The batches of a run are planned before any sample is read (plans.py), from the sample ids
and lengths. On a cache still being extracted those come from the extraction plan
(cache_tools/plan.py), which the extractor writes at its start: `FollowCacheSet`
(cache_tools/followed.py, a sample source like a finished cache) is the list of samples that plan promises, in sample id order, and reading one waits until the part that
holds it is committed. Offline runs put their samples in the same order (`canonical_order`),
so a follow run and an offline run on the finished cache with the same settings read the same
batches in the same order and end with the same weights, whenever the parts arrived.

With `--shuffle-parts N` an epoch is planned group by group: consecutive groups of N planned
parts (by part number, the extraction's order), each shuffled, length-sorted and packed on its
own (`plan_epoch`). Training then follows the extraction closely and needs at most a group's
parts at once, which is what training while extracting, and a disk budget, need; the default
(0) shuffles the whole data, so the first step waits for most of the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from dflash.cache_tools.followed import (  # noqa: F401 (wait_for_plan: also imported from here)
    FollowCacheSet,
    announce_wait,
    wait_for_plan,
)
from dflash.cache_tools.sources import SampleSource, part_number
from dflash.runtime.findings import Finding

if TYPE_CHECKING:
    from dflash.train.config import DataConfig
    from dflash.train.data.loader import TrainLoader


class RunData(Protocol):
    """What the follow reports read of a run's data.TrainingData (which imports this module)."""

    caches: SampleSource
    loader: TrainLoader

def canonical_order(caches: SampleSource, indices: np.ndarray) -> np.ndarray:
    """`indices` sorted by (cache, sample id): the order batch plans start from, so that they do
    not depend on the order parts were committed in (several ranks, writer processes) or arrive."""
    if len(indices) == 0:
        return indices
    ids = caches.sample_ids()[indices]
    cache_of = np.searchsorted(caches.starts, indices, side="right") - 1
    return indices[np.lexsort((indices, ids, cache_of))]


def part_groups(caches: SampleSource, shuffle_parts: int) -> np.ndarray:
    """The plan group of every sample: its part's number // shuffle_parts, per cache."""
    if shuffle_parts < 0:
        from dflash.train.config import TrainConfigError

        raise TrainConfigError(Finding("train.shuffle-parts-negative", value=shuffle_parts))
    numbers = caches.part_numbers()
    cache_of = np.searchsorted(caches.starts, np.arange(len(caches)), side="right") - 1
    groups = numbers // shuffle_parts
    return cache_of * (int(groups.max(initial=0)) + 1) + groups


def open_follow(config: DataConfig, announce: Callable[[Finding], None] = announce_wait) -> FollowCacheSet:
    """The --follow cache of a run (exactly one --cache)."""
    from dflash.train.config import (
        TrainConfigError,  # (no torch; the config module is what every run has)
    )

    if len(config.cache) != 1:
        raise TrainConfigError(Finding("train.follow-several-caches", caches=len(config.cache)))
    if "://" in str(config.cache[0]):
        raise TrainConfigError(Finding("train.follow-remote", cache=str(config.cache[0])))
    caches = FollowCacheSet(config.cache[0], max_seq_len=config.max_seq_len,
                            verify_checksums=config.verify_checksums, announce=announce)
    check_extraction_budget(config, caches.cache_dir)
    return caches


def check_extraction_budget(config: DataConfig, cache_dir: Path) -> None:
    """A run not given --disk-budget follows a cache whose extraction has one: the budget's
    refusals (--shuffle-parts 0, a held-out split of the followed cache) hold for it too, as if it
    had been given the same --disk-budget. Without them the first evaluation, or the first batches,
    wait for parts the extraction has no room for while it waits for the trainer: neither moves."""
    import dataclasses

    from dflash.cache_tools.eviction import BUDGET_FILE, recorded_budget
    from dflash.train.config import TrainConfigError

    budget = recorded_budget(cache_dir)
    if config.disk_budget is not None or budget is None:
        return
    try:
        dataclasses.replace(config, disk_budget=str(budget))
    except TrainConfigError as e:
        raise TrainConfigError(Finding("train.follow-extraction-budget", cache=str(cache_dir), budget=budget,
                                       file=BUDGET_FILE, refusal=e.finding or str(e))) from None


def refuse_group_over_budget(caches: FollowCacheSet, shuffle_parts: int, budget: int) -> None:
    """Refuse (TrainConfigError) a --disk-budget that cannot hold one --shuffle-parts group of
    planned parts beside the parts one forward batch of the extraction spans (recorded in the
    cache's budget file; 0 where it is not): the run reads a group's parts in shuffled order and
    reports a part trained only once the group's batches are past it, so the extraction would
    wait for room while the trainer waits for the group's other parts, both for ever. A group's
    bytes are its tokens times the bytes per token of the parts committed so far or, before any,
    of the arrays' raw size (above the compressed size)."""
    from dflash.cache_tools.eviction import recorded_batch_bytes
    from dflash.train.config import TrainConfigError

    committed = caches.committed_records()
    tokens = sum(r.tokens for r in committed)
    if tokens:
        per_token = sum(r.nbytes for r in committed) / tokens  # measured on the committed parts
    else:  # the arrays' raw size: no part is committed yet
        per_token = float(sum((spec.width or 1) * spec.dtype.itemsize for spec in caches.reader.schema
                              if spec.per == "token"))
    group_tokens: dict[int, int] = {}
    group_parts: dict[int, int] = {}
    for k, part in enumerate(caches.plan.parts):
        g = part_number(part.name, k) // shuffle_parts
        group_tokens[g] = group_tokens.get(g, 0) + part.tokens
        group_parts[g] = group_parts.get(g, 0) + 1
    if not group_tokens:
        return
    largest = max(group_tokens, key=group_tokens.__getitem__)
    batch = recorded_batch_bytes(caches.cache_dir) or 0
    need = group_tokens[largest] * per_token + batch
    if need <= budget:
        return
    part_bytes = group_tokens[largest] * per_token / group_parts[largest]
    fits = int((budget - batch) // part_bytes) - 1  # a group plus the bound's one part
    raise TrainConfigError(Finding(
        "train.disk-budget-group", budget=budget, shuffle_parts=shuffle_parts, group_bytes=need - batch,
        parts=group_parts[largest], tokens=group_tokens[largest], bytes_per_token=per_token,
        measured_parts=len(committed) if tokens else 0, batch_bytes=batch, needed=need,
        fits=fits if fits >= 1 else None))


def trained_parts(caches: SampleSource, loader: TrainLoader) -> int:
    """Planned parts whose training samples all come in the batches this run has consumed in
    its current epoch (what progress shows, and what a disk budget may evict)."""
    return len(trained_part_names(caches, loader)[1])


def trained_part_names(caches: SampleSource, loader: TrainLoader) -> tuple[int, list[str]]:
    """The epoch of the loader's position and the planned parts that none of its remaining
    batches reads (parts without training samples among them); an epoch whose usable batches are
    all consumed is done: (epoch + 1, []). (`loader` is the run's `loader.TrainLoader`.)"""
    epoch, consumed = loader.epoch, loader.consumed
    if consumed >= loader.usable(epoch):
        return epoch + 1, []
    batches = loader.epoch_batches(epoch)[:consumed]
    done = np.zeros(len(caches), dtype=bool)
    if batches:
        done[np.concatenate(batches)] = True
    needed = np.zeros(len(caches), dtype=bool)
    needed[loader.indices] = True
    open_parts = set(np.unique(caches.sample_parts()[needed & ~done]).tolist())
    return epoch, [name for k, name in enumerate(caches.part_names()) if k not in open_parts]


def report_consumption(data: RunData, rank: int, world_size: int) -> None:
    """--follow: record in the cache what this rank has trained on as of its checkpoint just
    written (cache_tools/eviction.py), so that an extraction under a disk budget may evict it."""
    caches = data.caches
    if caches.follows:  # (a finished cache: no extraction waits for the report)
        epoch, parts = trained_part_names(caches, data.loader)
        caches.report_trained(parts, epoch=epoch, rank=rank, world_size=world_size)


def follow_fields(data: RunData) -> dict[str, float]:
    """Progress of both stages for the trainer's log: parts extracted and trained, data wait (s)."""
    caches = data.caches
    done = caches.progress()
    if done is None:  # (no extraction is followed)
        return {}
    return {"parts_extracted": done.committed, "parts_planned": done.planned,
            "parts_trained": trained_parts(caches, data.loader), "data_wait_s": round(data.loader.wait_seconds, 2)}

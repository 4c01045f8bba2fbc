"""What a run trains on: the caches opened (finished, followed or remote), checked against the
target, split into training and held-out samples, and planned into the loaders of every epoch;
the startup summary that says what was found. The batches themselves are loader.py's.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from dflash.cache_tools.cache_set import CacheSet, check_compatible, shared_data
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.identity import (
    Purpose,
    target_differences,
    target_identity,
    unrecorded_weights_note,
    weights_note,
)
from dflash.cache_tools.layers import validate_target_layer_ids
from dflash.cache_tools.manifest import WRITER_LOCK_FILE, Manifest, chat_templates
from dflash.cache_tools.sample_scores import heldout_scores, subset_scores
from dflash.cache_tools.sources import SampleSource
from dflash.runtime.findings import Finding
from dflash.runtime.locks import is_held, same_path
from dflash.runtime.lookup import sample_lookup_walk
from dflash.runtime.positions import target_positions
from dflash.train.config import DataConfig, TrainConfig, TrainConfigError
from dflash.train.data.follow import (
    canonical_order,
    open_follow,
    part_groups,
    refuse_group_over_budget,
)
from dflash.train.data.heldout import cap_by_score, eval_split, without_top1
from dflash.train.data.loader import TrainLoader, eval_batches
from dflash.train.measure.reporting import unlike_heldout_finding

FEW_HELDOUT = 100  # fewer evaluated samples than this: the summary says the held-out tau is noisy
FEW_HELDOUT_GROUPS = 64  # fewer held-out groups than this: the summary says the estimate rests on too few documents
FEW_TRAINING = 8192  # fewer training samples than this: the summary says what such data gave (docs/recipe.md)
TEXT_SAMPLES = 512  # training samples whose text prompt lookup walks, beside the held-out samples' (text_lookup)


def check_cache_target(manifest: Manifest, target_config: Any, target_dir: str, *,
                       caches: SampleSource | None = None) -> list[Finding]:
    """Refuse a cache extracted from another model than the target given to the trainer (the
    identity fields both record: cache_tools.identity), or with layer ids a drafter cannot use.
    Returns notices for the run to emit: the target's weights differ from the cache's (same
    config), the cache is still being written (unless `caches` follow it)."""
    current = target_identity(target_config, target_dir)
    diffs = [(k, repr(b), repr(a))  # [key, the cache's, the target's]
             for k, a, b in target_differences(current, manifest.header.get("target"), Purpose.TRAIN)]
    if manifest.hidden_size != target_config.hidden_size:
        diffs.append(("hidden.hidden_size", repr(manifest.hidden_size), repr(target_config.hidden_size)))
    bad_layers = [i for i in manifest.target_layer_ids if not 0 <= i < target_config.num_hidden_layers]
    if diffs or bad_layers:
        raise ConfigMismatchError(Finding(
            "train.cache-other-target", cache=str(manifest.cache_dir), target=str(target_dir),
            differences=[list(d) for d in dict.fromkeys(diffs)], missing_layers=bad_layers or None,
            num_layers=target_config.num_hidden_layers))
    validate_target_layer_ids(manifest.target_layer_ids, target_config.num_hidden_layers, purpose="cache",
                              cache=str(manifest.cache_dir))
    notes = [weights_note(manifest.header.get("target"), current, cache=str(manifest.cache_dir), target=str(target_dir)),
             unrecorded_weights_note(manifest.header.get("target"), current, purpose="cache",
                                     path=str(manifest.cache_dir)),
             long_samples_note(manifest, target_config)]
    if not (caches is not None and caches.follows) and is_held(os.path.join(manifest.cache_dir, WRITER_LOCK_FILE)):
        notes.append(Finding("train.cache-being-written", cache=str(manifest.cache_dir), parts=len(manifest.parts)))
    return [n for n in notes if n]


def long_samples_note(manifest: Manifest, target_config: Any) -> Finding | None:
    """A notice for a cache holding samples longer than the target's positions, or None.

    dflash-extract holds samples to them (runtime.positions); a cache extracted before it did may
    hold longer ones, whose hidden states past the last position are out of the target's range."""
    positions = target_positions(target_config)
    if positions is None:
        return None
    longer = [n for part in manifest.parts for n in part.lengths if n > positions.limit]
    if not longer:
        return None
    return Finding("train.cache-long-samples", cache=str(manifest.cache_dir), samples=len(longer),
                   longest=max(longer), limit=positions.limit, source=positions.source)


def count_heldout_groups(caches: SampleSource, heldout: np.ndarray) -> tuple[int, int] | None:
    """(held-out groups, all groups) of the samples whose records name a group; None without any
    (or for a followed cache, whose plan does not say which are grouped)."""
    grouped = caches.grouped()
    if grouped is None or not grouped.any():
        return None
    keys = caches.split_keys()
    held = np.zeros(len(caches), dtype=bool)
    held[heldout] = True
    return len(np.unique(keys[grouped & held])), len(np.unique(keys[grouped]))


def few_groups_warning(held: int, total: int, fraction: float) -> Finding:
    """The startup's warning for a split that holds out fewer than FEW_HELDOUT_GROUPS whole groups,
    with the --eval-fraction that would hold out about that many."""
    wanted = min(FEW_HELDOUT_GROUPS, total)
    suggest = min(0.5, max(fraction, math.ceil(100 * wanted / total) / 100))
    return Finding("train.few-heldout-groups", held=held, eval_fraction=suggest, groups=wanted)


@dataclass
class TrainingData:
    """The caches, the split and the loaders of a run."""

    caches: SampleSource
    train_indices: np.ndarray
    loader: TrainLoader
    eval_caches: CacheSet | None
    eval_indices: np.ndarray
    """The samples evaluated (at most --eval-max-samples of the held-out ones)."""
    config: DataConfig
    pin_memory: bool = False
    """Batches collate into pinned host memory (the run's device is a GPU)."""
    heldout_count: int = 0
    """Samples kept out of training (of the training caches, or of --eval-cache)."""
    train_cap: int = 0
    """--max-train-samples, when it left samples out of training."""
    heldout_groups: tuple[int, int] | None = None
    """(held-out groups, all groups) when the records name groups (the split holds out whole groups)."""
    eval_without_top1: int = 0
    """Evaluated samples whose cache holds no target top-1 for them (outside its --top1-share)."""
    warnings: list[Finding] = field(default_factory=list)
    """What the startup warns of beyond the split and the data (`caveats`)."""
    estimate: bool = False
    """`dflash-train estimate`: its cache is the held-out set, and it trains on nothing."""
    _text_lookup: dict[int, tuple[float, int] | None] = field(default_factory=dict, repr=False)

    def text_samples(self) -> np.ndarray | None:
        """The training samples whose text the held-out samples' is set beside (text_lookup,
        training_confidence): up to TEXT_SAMPLES drawn at random (seeded, so every evaluation and
        rank reads the same ones, spread over the records' groups), sorted; None for a followed
        cache, an estimate, or an --eval-cache (its samples are not a draw of the same data: greedy
        completions of other prompts, surer and more repetitive than half-sampled ones by kind)."""
        if (self.caches.follows or self.estimate or self.eval_caches is not None
                or not len(self.train_indices)):
            return None
        count = min(TEXT_SAMPLES, len(self.train_indices))
        return np.sort(np.random.default_rng(0).choice(self.train_indices, size=count, replace=False))

    @functools.cached_property
    def training_confidence(self) -> tuple[float, int] | None:
        """The target's mean top-1 probability over the loss tokens of the text_samples (its
        stored top-k log-probs), and how many: how sure the target is of the training text, which
        the held-out samples' figure is set beside (a split of documents the target finds easy
        reads high). None without top-k log-probs, for a followed cache or an estimate."""
        chosen = self.text_samples()
        return None if chosen is None else mean_top1_prob(self.caches, chosen)

    def text_lookup(self, block_size: int) -> tuple[float, int] | None:
        """Prompt lookup's tau along the training text: walked (runtime/lookup.py) along the
        tokens of up to TEXT_SAMPLES training samples drawn at random (seeded, so every
        evaluation and rank reads the same ones, spread over the records' groups), as the
        evaluation walks it along the held-out samples. It says how repetitive the training text
        is, which the held-out text's figure is set beside: held-out documents that repeat
        themselves more are easier for a drafter too. (tau, samples walked); None for a followed
        cache or an estimate."""
        if block_size not in self._text_lookup:
            chosen = self.text_samples()
            self._text_lookup[block_size] = None if chosen is None else _walked_text(self.caches, chosen, block_size)
        return self._text_lookup[block_size]

    def unlike_heldout_note(self, block_size: int) -> Finding | None:
        """The startup's note when the held-out samples are unlike the training ones: the target
        surer or less sure of them, or (without top-k log-probs) their text repeating itself more
        or less (reporting.unlike_heldout_finding; None otherwise)."""
        text = confidence = None
        training = self.training_confidence
        held = None if training is None else mean_top1_prob(self.caches, self.eval_indices)
        if held is not None and training is not None:
            confidence = [held[0], *training]
        else:
            held_text, training_text = self.heldout_text_lookup(block_size), self.text_lookup(block_size)
            if held_text is not None and training_text is not None:
                text = [held_text[0], *training_text]
        return unlike_heldout_finding(text, confidence, ahead=True)

    def heldout_text_lookup(self, block_size: int) -> tuple[float, int] | None:
        """Prompt lookup's tau along the evaluated held-out samples' text, as text_lookup walks the
        training text; None without held-out samples, for a followed cache, an estimate or an
        --eval-cache (text_samples)."""
        if (self.caches.follows or self.estimate or self.eval_caches is not None
                or not len(self.eval_indices)):
            return None
        return _walked_text(self.caches, self.eval_indices, block_size)

    def eval_loader(self, rank: int, world_size: int, max_batches: int = 0
                    ) -> tuple[torch.utils.data.DataLoader, int] | None:
        """loader.eval_batches over the held-out samples: the loader and how many of its batches count."""
        caches = self.eval_caches if self.eval_caches is not None else self.caches
        return eval_batches(caches, self.eval_indices, self.config, rank=rank, world_size=world_size,
                            max_batches=max_batches, pin_memory=self.pin_memory)

    def heldout_caveat(self) -> str:
        """For the run's last line: what its held-out tau rests on when the split holds out fewer
        than FEW_HELDOUT_GROUPS whole groups ("" otherwise)."""
        if not self.heldout_count or self.heldout_groups is None:
            return ""
        held, total = self.heldout_groups
        if held >= FEW_HELDOUT_GROUPS or total <= held:
            return ""
        return (f"That held-out tau rests on {held} whole group(s) of the records (documents), too few to trust "
                f"within 10 % (on the project's BPE benchmark 16 held-out files of 867 read 1.42x the decoded tau): "
                "measure the drafter with dflash-eval on prompts of other documents")

    def summary(self) -> str:
        """The startup summary of the data: one line of figures (and the chat template its data was
        rendered with); what it warns of are `caveats`."""
        c = self.caches
        where = "in --eval-cache" if self.eval_caches is not None else "held out"
        head = (f"data: {len(c.readers)} cache(s), {len(c)} samples, {int(c.full_lengths.sum())} tokens; "
                f"{len(self.train_indices)} for training, {self.heldout_count} {where}")
        if self.train_cap:
            head += f" (capped by --max-train-samples {self.train_cap})"
        if len(self.eval_indices) < self.heldout_count:
            head += f" ({len(self.eval_indices)} evaluated, --eval-max-samples)"
        if self.heldout_groups is not None:
            held, total = self.heldout_groups
            head += f" ({held} of {total} record groups held out whole)"
        head += f"; {self.loader.total_steps} optimizer steps over {len(self.loader.steps_per_epoch)} epoch(s)"
        lines = [head]
        if (rendering := rendering_summary([r.manifest.header for r in c.readers])) is not None:
            lines.append(rendering)
        return "\n".join(lines)

    def caveats(self) -> list[Finding]:
        """What the startup warns of: the held-out estimate (none, few samples or groups, no target
        top-1 for some), few training samples, truncated samples, chat templates that differ."""
        c, found = self.caches, []
        if not self.heldout_count:
            found.append(Finding("train.no-heldout"))
        elif len(self.eval_indices) < FEW_HELDOUT:
            found.append(Finding("train.few-heldout", samples=len(self.eval_indices)))
        if self.heldout_count and self.heldout_groups is not None:
            held, total = self.heldout_groups
            if held < FEW_HELDOUT_GROUPS and total > held:
                found.append(few_groups_warning(held, total, self.config.eval_fraction))
        held_caches = self.eval_caches if self.eval_caches is not None else c
        if self.heldout_count and not held_caches.manifest.top1 and not held_caches.manifest.topk:
            found.append(Finding("train.heldout-no-top1", cache=str(held_caches.manifest.cache_dir)))
        elif self.eval_without_top1:
            found.append(Finding("train.heldout-some-top1", samples=self.eval_without_top1,
                                 evaluated=len(self.eval_indices),
                                 top1_share=sorted({r.top1_share for r in held_caches.readers})))
        if len(self.train_indices) < FEW_TRAINING:
            found.append(Finding("train.few-training-samples", samples=len(self.train_indices)))
        found += self.warnings
        if c.truncated_samples:
            found.append(Finding("train.samples-truncated", samples=c.truncated_samples, max_seq_len=c.max_seq_len,
                                 tokens=c.truncated_tokens))
        if (templates := chat_templates_differ([r.manifest.header for r in c.readers])) is not None:
            found.append(templates)
        return found


def _walked_text(caches: CacheSet, indices: np.ndarray, block_size: int) -> tuple[float, int] | None:
    """(prompt lookup's tokens / cycles walked along the samples `indices`, how many)."""
    tokens = cycles = 0
    for ids, mask in caches.read_ids(np.sort(indices)):  # sorted: each part's arrays decoded once
        walked = sample_lookup_walk(ids, mask, block_size)
        tokens, cycles = tokens + walked[0], cycles + walked[1]
    return (tokens / cycles, len(indices)) if cycles else None


def mean_top1_prob(caches: CacheSet, indices: np.ndarray) -> tuple[float, int] | None:
    """(the target's top-1 probability averaged over the loss tokens of the samples `indices`,
    how many samples); None where a cache stores no top-k log-probs."""
    total = count = 0.0
    for logprobs, mask in caches.read_top1_logprobs(np.sort(indices)):  # sorted: each part decoded once
        if logprobs is None:
            return None
        total, count = total + float(np.exp(logprobs[mask]).sum()), count + int(mask.sum())
    return (total / count, len(indices)) if count else None


def _renderings(headers: list[dict[str, Any]]) -> list[list[Any]]:
    """The chat templates (sha256, kwargs) the caches' data was rendered with, as dflash-prepare /
    dflash-generate recorded them, each once."""
    renderings: list[dict[str, Any]] = []
    for header in headers:
        renderings += [r for r in chat_templates(header) if r not in renderings]
    return [[str(r.get("chat_template_sha256"))[:12], r.get("chat_template_kwargs", {})] for r in renderings]


def rendering_summary(headers: list[dict[str, Any]]) -> str | None:
    """The summary's line of the one chat template (and kwargs) the caches' data was rendered with;
    None for none, or for several (`chat_templates_differ` warns of them)."""
    renderings = _renderings(headers)
    if len(renderings) != 1:
        return None
    sha, kwargs = renderings[0]
    return f"chat template sha256 {sha} kwargs {json.dumps(kwargs)} (serve with the same)"


def chat_templates_differ(headers: list[dict[str, Any]]) -> Finding | None:
    """A warning when the caches' data was rendered with several chat templates or kwargs (serving
    renders with one); None otherwise."""
    renderings = _renderings(headers)
    return Finding("train.chat-templates-differ", templates=renderings) if len(renderings) > 1 else None


def open_cache_set(cache_dirs: list[str], config: DataConfig, *, finished: bool = True) -> CacheSet:
    """Finished caches as one list of samples; an s3:// one is staged under --staging-dir within
    --disk-budget. With `finished`, a cache whose extraction has not committed every planned part
    is refused (unless --allow-incomplete): training on it would leave the rest of the data out
    unsaid (`dflash-train estimate` reads what is there)."""
    caches = CacheSet(cache_dirs, max_seq_len=config.max_seq_len, verify_checksums=config.verify_checksums,
                      disk_budget=config.disk_budget_bytes(), staging_dir=config.staging_dir)
    unfinished = caches.unfinished()
    if unfinished and finished and not config.allow_incomplete:
        where, progress = unfinished[0]
        header = next(r.manifest.header for r in caches.readers if r.cache_dir == where)
        writer = "dflash-cache import" if (header.get("settings") or {}).get("imported_from") else "dflash-extract"
        raise TrainConfigError(Finding(
            "train.cache-unfinished", cache=str(where), committed=progress.committed, planned=progress.planned,
            committed_samples=progress.committed_samples, planned_samples=progress.planned_samples,
            more=len(unfinished) - 1, writer=writer))
    return caches


def refuse_shared_eval_data(caches: SampleSource, eval_caches: CacheSet) -> None:
    """An --eval-cache extracted from the same data as a --cache (a copy of it, under another
    path): the held-out tau would be measured on samples the drafter trains on."""
    for reader in caches.readers:
        for held in eval_caches.readers:
            if (digest := shared_data(reader, held)) is not None:
                raise TrainConfigError(Finding("train.eval-cache-same-data", eval_cache=str(held.cache_dir),
                                               cache=str(reader.cache_dir), digest=digest))


def refuse_repeated_caches(caches: list[str], eval_caches: list[str]) -> None:
    """The same cache twice among --cache (its samples would train twice an epoch), or one of
    them as --eval-cache too (the held-out tau would be measured on training samples)."""
    given = [(c, "--cache") for c in caches] + [(c, "--eval-cache") for c in eval_caches]
    for i, (path, flag) in enumerate(given):
        for other, other_flag in given[:i]:
            remote = str(path).startswith("s3://") or str(other).startswith("s3://")
            if not (str(path).rstrip("/") == str(other).rstrip("/") if remote else same_path(path, other)):
                continue
            if flag == other_flag:
                raise TrainConfigError(Finding("train.cache-given-twice", flag=flag, cache=str(path), other=str(other)))
            raise TrainConfigError(Finding("train.eval-cache-is-cache", eval_cache=str(path), cache=str(other)))


def open_training_data(run: TrainConfig, *, rank: int, world_size: int, pin_memory: bool,
                       estimate: bool = False) -> TrainingData:
    """Open the caches of the run's data section (manifests, and the sample ids for the split),
    split them and plan the batches of every epoch. --eval-cache, when given, replaces the
    held-out split. `estimate`: `dflash-train estimate`, whose --cache is its held-out set (it
    trains on nothing, so the cache stands as --eval-cache too)."""
    config, optimization = run.data, run.optimization
    if not estimate:
        refuse_repeated_caches(list(config.cache), list(config.eval_cache or []))
    followed = open_follow(config) if config.follow else None
    caches = followed if followed is not None else open_cache_set(config.cache, config, finished=not estimate)
    eval_caches = None
    if config.eval_cache:
        eval_caches = open_cache_set(config.eval_cache, config, finished=not estimate)
        check_compatible(caches.readers[0], eval_caches.readers[0])
        if not estimate:  # (an estimate's --cache is its held-out set, and stands as --eval-cache too)
            refuse_shared_eval_data(caches, eval_caches)
        train_indices = np.arange(len(caches), dtype=np.int64)
        heldout, scored = np.arange(len(eval_caches), dtype=np.int64), eval_caches
    else:
        train_indices, heldout = eval_split(caches, config.eval_fraction)
        scored = caches
    train_cap = 0
    if config.max_train_samples and len(train_indices) > config.max_train_samples:
        train_cap = config.max_train_samples
        train_indices = cap_by_score(train_indices, subset_scores(caches.split_keys()), config.max_train_samples)
    if len(train_indices) == 0:
        raise TrainConfigError(Finding("train.no-training-samples", caches=[str(c) for c in config.cache],
                                       samples=len(caches), eval_fraction=config.eval_fraction))
    eval_indices = heldout
    if config.eval_max_samples and len(heldout) > config.eval_max_samples:
        eval_indices = cap_by_score(heldout, heldout_scores(scored.split_keys()), config.eval_max_samples)
    # Plans start from sample id order: batches never depend on the order parts were committed in.
    train_indices, eval_indices = canonical_order(caches, train_indices), canonical_order(scored, eval_indices)
    groups = part_groups(caches, config.shuffle_parts) if config.shuffle_parts else None
    warnings: list[Finding] = []
    if followed is not None and config.disk_budget is not None:  # (the config asks for groups)
        refuse_group_over_budget(followed, config.shuffle_parts, config.disk_budget_bytes())
    loader = TrainLoader(caches, train_indices, config, seed=optimization.seed, epochs=optimization.epochs,
                         rank=rank, world_size=world_size, grad_accum=optimization.grad_accum, groups=groups,
                         pin_memory=pin_memory)
    return TrainingData(caches=caches, train_indices=train_indices, loader=loader, eval_caches=eval_caches,
                        eval_indices=eval_indices, config=config, pin_memory=pin_memory, heldout_count=len(heldout),
                        train_cap=train_cap, warnings=[w for w in warnings if w],
                        heldout_groups=None if eval_caches is not None else count_heldout_groups(caches, heldout),
                        eval_without_top1=without_top1(scored, eval_indices), estimate=estimate)

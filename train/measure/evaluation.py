"""The held-out evaluation: the trainer's estimate of the tau that speculative decoding gets.

`evaluate` runs the drafter over the held-out batches (this rank's share, every rank as many
forwards), scores its drafts against the samples' tokens and, where the cache holds the target's
top-1, against greedy verification, and walks whole samples as a decoder would
(metrics.VerificationWalk): docs/train.md, "Estimator". Prompt lookup's walk is replayed on the
same samples (runtime/lookup.py), so the held-out tau stands beside the free baseline's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import numpy as np
import torch
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.runtime.lookup import sample_lookup_walk
from dflash.train.config import TrainConfig
from dflash.train.data.caches import TrainingData
from dflash.train.data.loader import SPLIT_KEYS, dequantize_batch
from dflash.train.loss.objective import (
    ObjectiveConfig,
    anchor_chunks,
    compute_loss,
    eligible_anchors,
)
from dflash.train.measure.metrics import (
    MIN_GREEDY_SAMPLES,
    VerificationWalk,
    greedy_path,
    greedy_replay,
    read_by_estimate,
    reads_sampled,
    top1_known,
    walk_interval,
)
from dflash.train.measure.reporting import RunningMetrics
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.run.distributed import DistInfo, all_gather_rows, all_reduce_sum, any_rank
from torch import nn


class LossModel:
    """What compute_loss needs: calls go through the DDP/FSDP wrapper, attributes to the drafter."""

    def __init__(self, wrapped: nn.Module, drafter: DFlashDrafter):
        self.wrapped, self.drafter = wrapped, drafter

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)


@torch.no_grad()
def evaluate(loss_model: LossModel, data: TrainingData, objective: ObjectiveConfig,
             autocast: contextlib.AbstractContextManager, cfg: TrainConfig, info: DistInfo) -> dict[str, Any] | None:
    """Metrics on the held-out batches (no noise, a block at every eligible position),
    reduced over ranks. Without autograd: a graph kept per anchor chunk would hold every chunk's
    activations until the batch is walked (tens of GiB at a few thousand anchors a chunk)."""
    planned = data.eval_loader(info.rank, info.world_size, cfg.data.eval_max_batches)
    if planned is None:
        return None
    loader, own = planned  # batches past `own` only keep the ranks in step (FSDP): not counted
    loss_model.wrapped.eval()
    # Against the samples' tokens, and (when the cache holds the target's top-1 or top-k) replayed
    # as greedy verification; tau walks the blocks as a decoder would (docs/train.md, "Estimator").
    block_size = loss_model.drafter.config.block_size
    labels, greedy = RunningMetrics(block_size, info.device), RunningMetrics(block_size, info.device)
    walk = VerificationWalk((block_size, block_size // 2) if block_size >= 8 else (block_size,))
    backbone_walk = VerificationWalk((block_size,))  # with a head's choice: the backbone's top-1 without it
    held = (data.eval_caches if data.eval_caches is not None else data.caches).manifest
    replay = held.topk > 0 or held.top1 is not None
    clean = dataclasses.replace(objective, noise_type="none")
    lookups: list[list[float]] = []  # prompt lookup's [tokens, cycles] per walked sample, as walk.per_sample
    confidences: list[list[float]] = []  # the target's [top-1 probability summed, loss tokens] per walked sample
    with loss_model.drafter.eager():  # compiles for these shapes would cost more than they save
        for index, batch in enumerate(loader):
            keys = batch.pop(SPLIT_KEYS, None)  # each sample's cluster for the interval (exact as a float)
            clusters = None if keys is None else [k % (1 << 52) for k in keys.tolist()]
            batch = dequantize_batch({k: v.to(info.device, non_blocking=True) for k, v in batch.items()})
            eligible = eligible_anchors(batch["loss_mask"], batch["lengths"])
            outs, backbone_outs = [], []
            chunks = anchor_chunks(eligible, objective.max_anchors)
            mine = len(chunks)
            if info.distributed:  # as many forwards on every rank (FSDP's are collective)
                chunks += [chunks[-1]] * (any_rank(mine, info) - mine)
            for i, (positions, valid) in enumerate(chunks):
                chunk = {**batch, "anchor_positions": positions.to(info.device),
                         "anchor_valid": valid.to(info.device)}
                with autocast:
                    out = compute_loss(loss_model, chunk, clean)
                if index >= own or i >= mine:
                    continue  # another rank's batch or a repeat, run to keep the ranks' forwards in step
                labels.update(out, chunk)
                if out.backbone_predicted is not None:
                    backbone = dataclasses.replace(out, predicted=out.backbone_predicted, correct=out.backbone_correct)
                    backbone_outs.append(greedy_replay(backbone, chunk) if replay else backbone)
                if replay:
                    out = greedy_replay(out, chunk)
                    greedy.update(out, chunk)
                outs.append(out)
            if index >= own:
                continue
            path = greedy_path(batch) if replay else None  # where sampled tokens leave it
            known = top1_known(batch) if replay else None  # (--top1-share: rows without one)
            rows = walk.update(outs, eligible, path, known, clusters)
            lookups += lookup_rows(batch, rows, block_size)
            confidences += confidence_rows(batch, rows)
            if backbone_outs:
                backbone_walk.update(backbone_outs, eligible, path, known, clusters)
    loss_model.wrapped.train()
    by_labels = labels.compute(info)
    result = greedy.compute(info) if replay else by_labels
    walked = all_reduce_sum(walk.state(), info)
    taus = walk.taus(walked)
    per_sample = all_gather_rows(walk.per_sample, info)
    lookups, confidences = all_gather_rows(lookups, info), all_gather_rows(confidences, info)
    walked_counts = walk.walked(walked)
    if not walked_counts["walked_samples"]:
        raise InputError(Finding("train.nothing-to-evaluate", samples=len(data.eval_indices),
                                 eval_caches=list(data.config.eval_cache) if data.eval_caches is not None else None))
    # an estimate read from sampled completions with censored blocks is a Kaplan-Meier figure, which
    # has no like for like in a walk along the sampled tokens (a greedy completion's rare near-tie
    # censored block is fine, and so is a walk along sampled tokens that nothing censored)
    sampled = reads_sampled(per_sample) and walked_counts["censored_blocks"] > 0
    lookup = None if sampled else lookup_tau(per_sample, lookups)
    per_sample_mean = None if sampled else mean_sample_tau(per_sample)
    text = heldout_text_figures(data, per_sample, lookups, confidences, block_size,
                                adjust=block_size in taus and not sampled)
    kept = {k: v for k, v in result.items() if k in ("tau_from_acc", "blocks") or k.startswith("acc_")}
    estimator = ("greedy" if replay else "labels") + (" walk" if taus else " blocks")
    smaller = {f"tau_b{w}": t for w, t in taus.items() if w != block_size}
    if loss_model.drafter.head.picks_drafts:  # DFlash2: the backbone's tau beside the selector's
        backbone_taus = backbone_walk.taus(all_reduce_sum(backbone_walk.state(), info))
        if block_size in backbone_taus:
            smaller["tau_backbone"] = backbone_taus[block_size]
    return {"loss": by_labels["loss"], "tau": taus.get(block_size, result["tau"]), **smaller, **kept,
            "tau_blocks": result["tau"], "tau_labels": by_labels["tau"],
            **walked_counts,
            # its 95 % bootstrap interval over the samples walked, resampled by record group (or prompt):
            # the noise of a small held-out set
            "tau_interval": walk_interval(per_sample, taus[block_size]) if block_size in taus else [],
            # prompt lookup on the samples the estimate reads, at the drafter's block
            **({"tau_lookup": lookup} if lookup is not None else {}), **text,
            # the mean of each sample's tokens / cycles, as engines' per-prompt figure (tau pools them)
            **({"tau_per_sample_mean": per_sample_mean} if per_sample_mean is not None else {}),
            "estimator": estimator}


def heldout_text_figures(data: TrainingData, per_sample: list[list[float]], lookups: list[list[float]],
                         confidences: list[list[float]], block_size: int, adjust: bool) -> dict[str, float]:
    """Is the held-out text like the training text? How repetitive it is (prompt lookup walked
    along every walked sample's own tokens) and how sure the target is of it (its mean top-1
    probability, from the cache's top-k), each beside the training text's, and with `adjust` the
    estimate corrected by each (regression_adjusted_tau)."""
    out: dict[str, float] = {}
    if lookups and sum(c for _, c in lookups):
        out["lookup_text_heldout"] = sum(t for t, _ in lookups) / sum(c for _, c in lookups)
        training_text = data.text_lookup(block_size)
        if training_text is not None:
            out["lookup_text_training"], out["lookup_text_training_samples"] = training_text
            adjusted = text_adjusted_tau(per_sample, lookups, out["lookup_text_heldout"], training_text[0],
                                         block_size) if adjust else None
            if adjusted is not None:
                out["tau_text_adjusted"] = adjusted
    # (every walked sample's, or none: a row missing would shift the rest against per_sample)
    if len(confidences) == len(per_sample) and sum(n for _, n in confidences):
        out["confidence_heldout"] = sum(p for p, _ in confidences) / sum(n for _, n in confidences)
        training = data.training_confidence
        if training is not None:
            out["confidence_training"], out["confidence_training_samples"] = training
            means = [[p / n if n else math.nan] for p, n in confidences]
            adjusted = regression_adjusted_tau(per_sample, means, out["confidence_heldout"], training[0],
                                               block_size) if adjust else None
            if adjusted is not None:
                out["tau_confidence_adjusted"] = adjusted
    return out


def confidence_rows(batch: dict[str, torch.Tensor], rows: list[int]) -> list[list[float]]:
    """The target's [top-1 probability summed over the loss tokens, loss tokens] of each of the
    batch's `rows`, from its top-k log-probs (none without them)."""
    if not rows or "topk_logprobs" not in batch:
        return []
    probs = batch["topk_logprobs"][..., 0].float().exp() * batch["loss_mask"].float()
    sums, counts = probs.sum(-1).cpu().tolist(), batch["loss_mask"].sum(-1).cpu().tolist()
    return [[float(sums[b]), float(counts[b])] for b in rows]


def lookup_rows(batch: dict[str, torch.Tensor], rows: list[int], block_size: int) -> list[list[float]]:
    """Prompt lookup's [tokens, cycles] walked along each of the batch's `rows` (the samples the
    drafter's walk took, in its order), over the sample's own tokens and completion positions."""
    if not rows:
        return []
    ids, mask, lengths = batch["input_ids"].cpu(), batch["loss_mask"].cpu().bool(), batch["lengths"].cpu()
    walks = (sample_lookup_walk(ids[b, :int(lengths[b])].numpy(), mask[b, :int(lengths[b])].numpy(), block_size)
             for b in rows)
    return [[float(tokens), float(cycles)] for tokens, cycles in walks]


def regression_adjusted_tau(per_sample: list[list[float]], aux: list[list[float]], heldout_mean: float,
                            population_mean: float, block_size: int) -> float | None:
    """The held-out estimate corrected for how the held-out samples differ from the training
    ones in an auxiliary figure (a regression estimator): the drafter's cycles a token over the
    samples the estimate reads, plus their slope on the auxiliary figure x (each row of `aux`
    holds a sample's x, NaN where it has none; fitted over those samples, weighted by their
    tokens) times the training samples' mean x less the held-out ones'. x is prompt lookup's
    cycles a token (how repetitive the text is: tau_text_adjusted) or the target's mean top-1
    probability (how sure the target is of it: tau_confidence_adjusted): a split of few documents
    that drew easy ones reads high by what that slope says such text is worth. None with fewer
    than MIN_GREEDY_SAMPLES read, or no spread in x. Reported beside tau, not as it: how well it
    tracks decoded tau is measured on the quality benchmark (docs/BENCHMARKS.md)."""
    rows = [(row[1], row[2], x[0]) for row, x, read in zip(per_sample, aux, read_by_estimate(per_sample))
            if read and row[1] > 0 and math.isfinite(x[0])]
    if len(rows) < MIN_GREEDY_SAMPLES:
        return None
    tokens, cycles, x = (np.array(c, dtype=np.float64) for c in zip(*rows))
    y = cycles / tokens
    mean_x = np.average(x, weights=tokens)
    spread = np.average((x - mean_x) ** 2, weights=tokens)
    if spread <= 0:
        return None
    slope = np.average((x - mean_x) * (y - np.average(y, weights=tokens)), weights=tokens) / spread
    rate = cycles.sum() / tokens.sum() + slope * (population_mean - heldout_mean)
    return float(min(block_size, max(1.0, 1 / rate))) if rate > 0 else float(block_size)


def text_adjusted_tau(per_sample: list[list[float]], lookups: list[list[float]], heldout_text: float,
                      training_text: float, block_size: int) -> float | None:
    """regression_adjusted_tau on prompt lookup's cycles a token (`lookups`: [tokens, cycles] per
    walked sample), from the held-out text's lookup tau to the training text's."""
    rates = [[cycles / tokens if tokens > 0 else math.nan] for tokens, cycles in lookups]
    return regression_adjusted_tau(per_sample, rates, 1 / heldout_text, 1 / training_text, block_size)


def mean_sample_tau(per_sample: list[list[float]]) -> float | None:
    """The mean over the samples the estimate reads of each one's tokens / cycles (dflash-eval's
    per-prompt mean, where tau pools tokens over cycles); None without a walked sample."""
    taus = [row[1] / row[2] for row, read in zip(per_sample, read_by_estimate(per_sample)) if read and row[2] > 0]
    return sum(taus) / len(taus) if taus else None


def lookup_tau(per_sample: list[list[float]], lookups: list[list[float]]) -> float | None:
    """Prompt lookup's tokens / cycles over the samples the estimate reads (the greedy
    completions when there are MIN_GREEDY_SAMPLES of them, else all: VerificationWalk.taus);
    None without a walked sample."""
    use = [lk for lk, read in zip(lookups, read_by_estimate(per_sample)) if read]
    cycles = sum(c for _, c in use)
    return sum(t for t, _ in use) / cycles if cycles else None

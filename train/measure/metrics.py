"""Drafting quality from a batch's (or many batches') block predictions.

- `acc_k`: top-1 accuracy of block slot k (1..block_size-1) over scored slots.
- `tau`: expected acceptance length measured per block, as greedy verification would accept
  it: 1 (the target's bonus token) + the number of leading slots that are correct. A slot
  that is not scored (past the sequence end or outside the completion) ends the run, since
  nothing there can be checked; blocks whose first slot is not scored are not counted.
- `tau_from_acc`: the estimate 1 + sum_k prod_{j<=k} acc_j from the per-slot accuracies
  (it assumes independent errors, so it differs from `tau`).

On held-out samples of a cache that stores the target's top-1 (by default) or top-k,
`greedy_replay` checks each slot against the target's own greedy choice instead of the sample's
next token: what greedy verification accepts, so the estimate tracks what speculative decoding
measures. A sampled completion leaves the target's greedy path wherever its token is not the
target's top-1: past that token the cache holds no greedy choice of the decoder's own context,
so `VerificationWalk` ends the block's known slots there (a censored block) and counts it by
the Kaplan-Meier rule instead of as rejected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from dflash.train.loss.objective import LossOutput, target_top1


def leading_correct(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[..., S] -> [...]: number of leading slots that are scored and correct."""
    ok = (correct & valid).long()
    return ok.cumprod(dim=-1).sum(dim=-1)


@dataclass
class BlockMetrics:
    """Running sums over steps; `compute()` turns them into plain floats."""

    block_size: int
    loss_sum: float = 0.0
    steps: int = 0
    correct_per_slot: torch.Tensor = field(init=False)
    scored_per_slot: torch.Tensor = field(init=False)
    accepted_sum: float = 0.0
    blocks: int = 0

    def __post_init__(self) -> None:
        self.correct_per_slot = torch.zeros(self.block_size - 1, dtype=torch.float64)
        self.scored_per_slot = torch.zeros(self.block_size - 1, dtype=torch.float64)

    def update(self, correct: torch.Tensor, valid: torch.Tensor, loss: float | torch.Tensor | None = None) -> None:
        """Add one batch: `correct`, `valid` [B, A, block_size-1] bool (from `LossOutput`)."""
        correct, valid = correct.detach().cpu(), valid.detach().cpu()
        self.correct_per_slot += (correct & valid).flatten(0, -2).sum(0).double()
        self.scored_per_slot += valid.flatten(0, -2).sum(0).double()
        counted = valid[..., 0]
        self.accepted_sum += float(leading_correct(correct, valid)[counted].sum())
        self.blocks += int(counted.sum())
        if loss is not None:
            self.loss_sum += float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            self.steps += 1

    def compute(self) -> dict[str, float]:
        acc = (self.correct_per_slot / self.scored_per_slot.clamp(min=1)).tolist()
        out: dict[str, float] = {}
        if self.steps:
            out["loss"] = self.loss_sum / self.steps
        for k, a in enumerate(acc, start=1):
            out[f"acc_{k}"] = a
        out["tau"] = 1.0 + (self.accepted_sum / self.blocks if self.blocks else 0.0)
        out["tau_from_acc"] = tau_from_accuracies(acc)
        out["blocks"] = float(self.blocks)
        return out


def tau_from_accuracies(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the acceptance length if slot errors were independent."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def top1_known(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B] bool: which samples of the batch have the target's top-1 (the others are replayed
    against their own tokens, `target_top1`); None when all of them have it."""
    if "top1_known" not in batch or "topk_ids" in batch:
        return None
    return batch["top1_known"]


def greedy_path(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B, T] bool: token t of the sample is the target's greedy choice after tokens < t
    (always true at t = 0, false past the sample's end); None without the target's top-1."""
    top1 = target_top1(batch)
    if top1 is None:
        return None
    ids = batch["input_ids"]
    on = torch.ones_like(ids, dtype=torch.bool)
    on[:, 1:] = ids[:, 1:] == top1[:, :-1].to(ids.device)
    if "lengths" in batch:
        on &= torch.arange(ids.shape[1], device=ids.device)[None, :] < batch["lengths"].to(ids.device)[:, None]
    return on


def greedy_replay(out: LossOutput, batch: dict[str, torch.Tensor]) -> LossOutput:
    """`out` with `correct` replayed as greedy verification: slot k of the block at anchor p is
    accepted when the drafter's top-1 equals the target's top-1 at cache row p+k-1 (its greedy
    choice for token p+k after the sample's tokens up to p+k-1). Without the target's top-1 in
    the batch, `out` as it is (checked against the sample's tokens)."""
    top1 = target_top1(batch)
    if top1 is None or out.predicted is None:
        return out
    top1 = top1.to(out.predicted.device)  # [B, T]
    slots = out.predicted.shape[-1]
    rows = out.anchor_positions[:, :, None] + torch.arange(slots, device=top1.device)
    rows = rows.clamp(max=top1.shape[1] - 1)  # only unscored slots reach past the end
    greedy = top1.gather(1, rows.flatten(1)).view_as(rows)
    return dataclasses.replace(out, correct=(out.predicted == greedy) & out.valid)


GREEDY_SHARE = 0.95
"""A held-out sample whose completion tokens are the target's top-1 at least this often is a
greedy completion (a few near-ties may flip between generation and extraction numerics)."""
MIN_GREEDY_SAMPLES = 8
"""With at least this many greedy completions walked, the estimate is theirs alone."""


@dataclass
class _WalkCounts:
    """Sums of walked blocks per verified width (see VerificationWalk)."""

    widths: tuple[int, ...]
    tokens: list[int] = field(init=False)
    cycles: list[int] = field(init=False)
    censored: list[int] = field(init=False)
    at_risk: list[list[int]] = field(init=False)
    """Per width and slot k (1..width-1): walked blocks that reached slot k with it known."""
    rejected: list[list[int]] = field(init=False)
    """Per width and slot k: walked blocks whose first rejected draft was slot k."""
    samples: int = 0

    def __post_init__(self) -> None:
        n = len(self.widths)
        self.tokens, self.cycles, self.censored = [0] * n, [0] * n, [0] * n
        self.at_risk = [[0] * (w - 1) for w in self.widths]
        self.rejected = [[0] * (w - 1) for w in self.widths]

    def count(self, i: int, accepted: int, censored: bool) -> None:
        """One walked block of width i: `accepted` drafts, then a rejection (or the block's end),
        or, `censored`, nothing known past them."""
        self.tokens[i] += accepted + 1
        self.cycles[i] += 1
        slots = len(self.at_risk[i])
        for k in range(min(accepted + (0 if censored else 1), slots)):
            self.at_risk[i][k] += 1
        if censored:
            self.censored[i] += 1
        elif accepted < slots:
            self.rejected[i][accepted] += 1

    def values(self) -> list[float]:
        curves = [x for r, j in zip(self.at_risk, self.rejected) for x in (*r, *j)]
        return [*self.tokens, *self.cycles, *self.censored, self.samples, *curves]

    @property
    def size(self) -> int:
        return 3 * len(self.widths) + 1 + sum(2 * (w - 1) for w in self.widths)

    def taus(self, values: list[float]) -> dict[int, float]:
        """Width -> tokens / cycles, or with censored blocks the Kaplan-Meier mean cycle length
        1 + sum_k prod_{j<=k} (1 - rejected_j / at_risk_j)."""
        n = len(self.widths)
        out, pos = {}, 3 * n + 1
        for i, w in enumerate(self.widths):
            at_risk, rejected = values[pos:pos + w - 1], values[pos + w - 1:pos + 2 * (w - 1)]
            pos += 2 * (w - 1)
            if not values[n + i]:
                continue
            if not values[2 * n + i]:  # nothing censored: exactly tokens / cycles
                out[w] = values[i] / values[n + i]
                continue
            tau, survive = 1.0, 1.0
            for risk, rej in zip(at_risk, rejected):
                if not risk:
                    break
                survive *= 1 - rej / risk
                tau += survive
            out[w] = tau
        return out


@dataclass
class VerificationWalk:
    """Greedy decoding replayed along whole held-out samples: tokens and cycles summed.

    In speculative decoding a block starts where the previous one's accepted run ended, not at
    a random position: runs of easy text are crossed in a few long blocks, hard text in many
    short ones, so the per-block mean over random anchors counts easy text too often and
    overstates tau. On a sample whose every eligible position was an anchor, the walk starts at
    the first one (the token the target produced from the prompt), takes that block's
    acceptance length a (accepted slots + 1), moves a positions on, and repeats to the end:
    tokens / cycles is what a decoder verifying those blocks measures (its last cycle cut at
    the sample's end). A sample with a block missing at some eligible position is not walked.

    `block_sizes` are the verified widths walked (each at most the drafter's block): a decoder
    run at a smaller `--block-size` verifies the first B-1 drafts of the drafter's block.

    With the target's top-1 (`on_path`), a sampled completion leaves the target's greedy path at
    every token that is not the target's top-1 (position d). A block whose drafts are accepted
    up to d is censored there: the decoder would go on along its own greedy token, whose next
    choices the cache does not hold. The walk goes on from d, and the mean cycle length is the
    Kaplan-Meier estimate over accepted-slot counts (slot k's rejection rate among the blocks
    that reached it with slot k known). Sampled text is not the text a greedy decoder writes,
    though: when at least MIN_GREEDY_SAMPLES walked samples are greedy completions (GREEDY_SHARE
    of their tokens on the path), the estimate is theirs alone, where the walk is the decoder's.
    """

    block_sizes: tuple[int, ...]
    greedy: _WalkCounts = field(init=False)
    """The samples on the target's greedy path (all of them without `on_path`)."""
    others: _WalkCounts = field(init=False)
    """The sampled ones."""

    per_sample: list[list[float]] = field(init=False)
    """Per walked sample, [greedy (1 or 0), tokens, cycles] at the first width: what the
    estimate's interval resamples (`interval`)."""

    def __post_init__(self) -> None:
        self.greedy, self.others = _WalkCounts(self.block_sizes), _WalkCounts(self.block_sizes)
        self.per_sample = []

    @property
    def samples(self) -> int:
        return self.greedy.samples + self.others.samples

    def update(self, outs: list[LossOutput], eligible: torch.Tensor, on_path: torch.Tensor | None = None,
               has_top1: torch.Tensor | None = None, clusters: list[int] | None = None) -> list[int]:
        """Add one batch: its outputs (blocks of one batch over one or more anchor chunks),
        `eligible` [B, T] bool, `objective.eligible_anchors` of the batch, `on_path`
        [B, T] bool, `greedy_path` of the batch (None: the samples are the path), and `has_top1`
        [B] bool, the batch's `top1_known`: a sample without its top-1 is walked along its own
        tokens and never counted as a greedy completion (nothing says it is one). `clusters`: each
        row's cluster for walk_interval (its split key), recorded as the 4th field of per_sample.
        Returns the rows walked, in the order their per_sample rows were added."""
        by_position: list[dict[int, int]] = [{} for _ in range(eligible.shape[0])]
        scored: list[dict[int, int]] = [{} for _ in range(eligible.shape[0])]  # scored slots per block
        for out in outs:
            leading = leading_correct(out.correct, out.valid).cpu()
            slots = out.valid.sum(-1).cpu()
            anchors, valid = out.anchor_positions.cpu(), out.anchor_valid.cpu()
            for b in range(anchors.shape[0]):
                at = anchors[b][valid[b]].tolist()
                by_position[b].update(zip(at, leading[b][valid[b]].tolist()))
                scored[b].update(zip(at, slots[b][valid[b]].tolist()))
        runs = None if on_path is None else _runs_on_path(on_path.cpu())
        walked_rows = []
        for b, blocks in enumerate(by_position):
            if not blocks or len(blocks) != int(eligible[b].sum()):
                continue
            run = None if runs is None else runs[b]
            counts = self.greedy
            if run is not None:
                after = [run[p + 1] > 0 for p in blocks if p + 1 < len(run) and scored[b][p]]
                greedy = sum(after) >= GREEDY_SHARE * max(1, len(after)) and (has_top1 is None or bool(has_top1[b]))
                counts = self.greedy if greedy else self.others
            tokens, cycles = counts.tokens[0], counts.cycles[0]
            for i, width in enumerate(self.block_sizes):
                p = min(blocks)
                while p in blocks:
                    accepted, censored = min(blocks[p], width - 1), False
                    if run is not None:
                        known = 1 + run[p + 1] if p + 1 < len(run) else width  # drafts whose check is known
                        # censored: every known draft accepted, and the next is scored (a sampled
                        # token there, not the sample's end)
                        censored = accepted >= known and known < min(width - 1, scored[b][p])
                        accepted = min(accepted, known)
                    counts.count(i, accepted, censored)
                    p += accepted if censored else accepted + 1  # censored: on from the sampled token
            counts.samples += 1
            walked_rows.append(b)
            self.per_sample.append([float(counts is self.greedy), float(counts.tokens[0] - tokens),
                                    float(counts.cycles[0] - cycles), *([float(clusters[b])] if clusters else [])])
        return walked_rows

    def state(self) -> torch.Tensor:
        """The greedy samples' sums, then the sampled ones' (sum it over ranks)."""
        return torch.tensor([*self.greedy.values(), *self.others.values()], dtype=torch.float64)

    def _split(self, summed: torch.Tensor) -> tuple[list[float], list[float]]:
        values = summed.tolist()
        return values[:self.greedy.size], values[self.greedy.size:]

    def walked(self, summed: torch.Tensor) -> dict[str, float]:
        """Walked samples, of them greedy completions, and the share of censored blocks of
        what the estimate reads (0 on greedy completions)."""
        greedy, others = self._split(summed)
        n = len(self.block_sizes)
        g = greedy[3 * n]
        used = greedy if g >= MIN_GREEDY_SAMPLES or not others[3 * n] else [a + b for a, b in zip(greedy, others)]
        return {"walked_samples": g + others[3 * n], "greedy_samples": g,
                "censored_blocks": sum(used[2 * n:3 * n]) / max(1.0, sum(used[n:2 * n]))}

    def taus(self, summed: torch.Tensor) -> dict[int, float]:
        """Block size -> mean cycle length of (possibly rank-summed) `state()`s: the greedy
        completions' when there are MIN_GREEDY_SAMPLES of them, else every walked sample's;
        empty when no sample was walked."""
        greedy, others = self._split(summed)
        n = len(self.block_sizes)
        if greedy[3 * n] >= MIN_GREEDY_SAMPLES or not others[3 * n]:
            return self.greedy.taus(greedy)
        return self.greedy.taus([a + b for a, b in zip(greedy, others)])


def read_by_estimate(per_sample: list[list[float]]) -> list[bool]:
    """Which rows of VerificationWalk.per_sample the estimate reads: the greedy completions when
    there are MIN_GREEDY_SAMPLES of them, else every walked sample (VerificationWalk.taus)."""
    greedy_only = sum(1 for row in per_sample if row[0] == 1) >= MIN_GREEDY_SAMPLES
    return [row[0] == 1 or not greedy_only for row in per_sample]


def reads_sampled(per_sample: list[list[float]]) -> bool:
    """Whether the estimate reads sampled completions (too few greedy ones among the walked
    samples): where it also censored blocks at their sampled tokens, its figure is a Kaplan-Meier
    one, and a figure walked along the samples' own tokens (prompt lookup, a per-sample mean) is
    not like for like.
    A greedy completion may still hold a censored block or two: a token the extraction's target
    ranks second at a near tie (bf16), within GREEDY_SHARE; that does not make it sampled text."""
    return any(row[0] != 1 for row, read in zip(per_sample, read_by_estimate(per_sample)) if read)


def walk_interval(per_sample: list[list[float]], tau: float, resamples: int = 2000, seed: int = 0) -> list[float]:
    """The 95 % bootstrap interval of a walk's estimate `tau` at its first width, over the
    samples it reads (VerificationWalk.per_sample of every rank: the greedy completions when
    there are MIN_GREEDY_SAMPLES of them, else all), resampled with replacement: the pooled
    tokens / cycles of each resample, scaled by tau over the pooled figure (1 where no block was
    censored; with censored blocks the Kaplan-Meier estimate's interval is taken as the pooled
    ratio's, scaled). Rows with a 4th field (their cluster: the record group, or the prompt) are
    resampled a cluster at a time, since the samples of one document do not vary independently;
    with every cluster a single sample this is the per-sample interval. Empty with fewer than two
    clusters."""
    width = 4 if per_sample and len(per_sample[0]) == 4 else 3
    ordered = sorted(per_sample)  # sorted: the same for any order of the samples (ranks, batches)
    rows = np.asarray(ordered, dtype=np.float64).reshape(-1, width)
    rows = rows[np.asarray(read_by_estimate(ordered), dtype=bool)] if len(rows) else rows
    rows = rows[rows[:, 2] > 0]
    tokens, cycles = rows[:, 1], rows[:, 2]
    if width == 4:  # per cluster, in the order of its first row
        _, first, which = np.unique(rows[:, 3], return_index=True, return_inverse=True)
        order = np.argsort(first)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        tokens = np.bincount(rank[which], weights=tokens, minlength=len(order))
        cycles = np.bincount(rank[which], weights=cycles, minlength=len(order))
    if len(tokens) < 2:
        return []
    draw = np.random.default_rng(seed).integers(0, len(tokens), size=(resamples, len(tokens)))
    pooled = tokens[draw].sum(1) / cycles[draw].sum(1)
    scale = tau / (tokens.sum() / cycles.sum())
    return [float(np.percentile(pooled, 2.5) * scale), float(np.percentile(pooled, 97.5) * scale)]


def _runs_on_path(on_path: torch.Tensor) -> list[list[int]]:
    """Per sample and position t: how many tokens from t on are on the greedy path in a row."""
    out = []
    for row in on_path.tolist():
        run, count = [0] * len(row), 0
        for t in range(len(row) - 1, -1, -1):
            count = count + 1 if row[t] else 0
            run[t] = count
        out.append(run)
    return out

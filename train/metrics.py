"""Drafting quality from a batch's (or many batches') block predictions.

- `acc_k`: top-1 accuracy of block slot k (1..block_size-1) over scored slots.
- `tau`: expected acceptance length measured per block, as greedy verification would accept
  it: 1 (the target's bonus token) + the number of leading slots that are correct. A slot
  that is not scored (past the sequence end or outside the completion) ends the run, since
  nothing there can be checked; blocks whose first slot is not scored are not counted.
- `tau_from_acc`: the estimate 1 + sum_k prod_{j<=k} acc_j from the per-slot accuracies
  (it assumes independent errors, so it differs from `tau`).

On held-out samples of a cache that stores the target's top-k, `greedy_replay` checks each
slot against the target's own greedy choice (top-1) instead of the sample's next token: what
greedy verification accepts, so the estimate tracks what speculative decoding measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .objective import LossOutput


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


def block_metrics(correct: torch.Tensor, valid: torch.Tensor, loss: float | torch.Tensor | None = None) -> dict[str, float]:
    """Metrics of a single batch (see the module docstring for the definitions)."""
    m = BlockMetrics(block_size=correct.shape[-1] + 1)
    m.update(correct, valid, loss)
    return m.compute()


def greedy_replay(out: LossOutput, batch: dict[str, torch.Tensor]) -> LossOutput:
    """`out` with `correct` replayed as greedy verification: slot k of the block at anchor p is
    accepted when the drafter's top-1 equals the target's top-1 at cache row p+k-1 (its greedy
    choice for token p+k after the sample's tokens up to p+k-1). Without top-k in the batch,
    `out` as it is (checked against the sample's tokens)."""
    if "topk_ids" not in batch or out.predicted is None:
        return out
    top1 = batch["topk_ids"][..., 0].to(out.predicted.device)  # [B, T]; topk is sorted, best first
    slots = out.predicted.shape[-1]
    rows = out.anchor_positions[:, :, None] + torch.arange(slots, device=top1.device)
    rows = rows.clamp(max=top1.shape[1] - 1)  # only unscored slots reach past the end
    greedy = top1.gather(1, rows.flatten(1)).view_as(rows)
    return dataclasses.replace(out, correct=(out.predicted == greedy) & out.valid)


@dataclass
class VerificationWalk:
    """Greedy decoding replayed along whole held-out samples: tokens and cycles summed.

    In speculative decoding a block starts where the previous one's accepted run ended, not at
    a random position: runs of easy text are crossed in a few long blocks, hard text in many
    short ones, so the per-block mean over random anchors counts easy text too often and
    overstates tau. On a sample whose every eligible position was an anchor, the walk starts at
    the first one (the token the target produced from the prompt), takes that block's
    acceptance length a (accepted slots + 1), moves a positions on, and repeats to the end:
    tokens / cycles is what a decoder verifying those blocks measures. A sample with a block
    missing at some eligible position is not walked.

    `block_sizes` are the verified widths walked (each at most the drafter's block): a decoder
    run at a smaller `--block-size` verifies the first B-1 drafts of the drafter's block.
    """

    block_sizes: tuple[int, ...]
    tokens: list[int] = field(init=False)
    cycles: list[int] = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        self.tokens, self.cycles = [0] * len(self.block_sizes), [0] * len(self.block_sizes)

    def update(self, outs: list[LossOutput], eligible: torch.Tensor) -> None:
        """Add one batch: its outputs (blocks of one batch over one or more anchor chunks) and
        `eligible` [B, T] bool, `objective.eligible_anchors` of the batch."""
        by_position: list[dict[int, int]] = [{} for _ in range(eligible.shape[0])]
        for out in outs:
            leading = leading_correct(out.correct, out.valid).cpu()
            anchors, valid = out.anchor_positions.cpu(), out.anchor_valid.cpu()
            for b in range(anchors.shape[0]):
                by_position[b].update(zip(anchors[b][valid[b]].tolist(), leading[b][valid[b]].tolist()))
        for b, blocks in enumerate(by_position):
            if not blocks or len(blocks) != int(eligible[b].sum()):
                continue
            for i, width in enumerate(self.block_sizes):
                p = min(blocks)
                while p in blocks:
                    a = 1 + min(blocks[p], width - 1)
                    self.tokens[i] += a
                    self.cycles[i] += 1
                    p += a
            self.samples += 1

    def state(self) -> torch.Tensor:
        """[tokens per width..., cycles per width..., samples] (sum it over ranks)."""
        return torch.tensor([*self.tokens, *self.cycles, self.samples], dtype=torch.float64)

    def taus(self, summed: torch.Tensor) -> dict[int, float]:
        """Block size -> tokens / cycles of (possibly rank-summed) `state()`s; empty when no
        sample was walked."""
        n = len(self.block_sizes)
        values = summed.tolist()
        return {w: values[i] / values[n + i] for i, w in enumerate(self.block_sizes) if values[n + i]}

"""DFlash2's selector gather-reductions (train/heads/dflash2/kernels.py `gather_dot`) by how the
candidates of a step's slots are spread over the vocabulary.

The backward of the successor codebook's reduction adds every slot's update into the rows of its
candidates (a scatter-add): where many slots share a candidate, their adds meet on one row. A freshly
initialised drafter, as bench_train and profile_step train, proposes nearly the same top-16 for
every slot (on the CPU at the quality benchmark's shape: 23 distinct candidates over 3,677 slots, one
of them in every slot), while a trained drafter's candidates follow the text. So each reduction is
timed, forward and backward, over candidates drawn three ways:

- `collapsed`: every slot the same 16 candidates (a fresh drafter's);
- `zipf`: each slot's 16 drawn from a Zipf law over the vocabulary (s = 1, as word frequencies;
  a stand-in for a trained drafter's, not a measurement of one);
- `uniform`: drawn uniformly;

each with the slot's label (uniform) as the 17th. The reductions: the successor codebook's
(`left` [N, rank] against the codebook [V, rank], both trained) and the head rows' (the states
[N, D] against the frozen head [V, D]). Compiled on a GPU, as the trainer runs them; each compiled
form's values are checked against the eager one before it is timed. Beside them, a candidate for the
codebook's gradient without the scatter-add's atomic adds: the slots' updates sorted by candidate
and summed row by row as one sparse (CSR) [V, N] x [N, rank] product (`csr_table_grad`), whose
values are checked against the trainer's before it is timed.

    python bench/bench_selector_grad.py                  # one GPU: the 8B shape and the small drafter's
    python bench/bench_selector_grad.py --slots 256 --vocab 4096 --hidden 64 --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from dflash.train.heads.dflash2.kernels import _GatherDot, _rows_sum, gather_dot
from dflash.train.loss.compiled import compiled_over_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import report_rows, timed  # noqa: E402

DISTRIBUTIONS = ("collapsed", "zipf", "uniform")
SHAPES = {"8b": (512 * 15, 151_936, 4096), "quality-bpe": (10_240 * 15, 8192, 384)}
"""(slots, vocabulary, hidden) of a step: the 8B shape's 512 anchors, the small drafter's 10,240 blocks."""


def candidates(distribution: str, slots: int, vocab: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[slots, k + 1] ids: k candidates drawn as `distribution` says, then a uniform label."""
    if distribution == "collapsed":
        picked = torch.randperm(vocab, generator=generator)[:k].expand(slots, k)
    elif distribution == "zipf":  # k distinct ids a slot, as a top-k: the first k distinct of 4k draws
        weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        draws = torch.multinomial(weights, slots * 4 * k, replacement=True, generator=generator).view(slots, 4 * k)
        ranks, at = draws.sort(dim=1)
        repeat = torch.cat([torch.zeros(slots, 1, dtype=torch.bool), ranks[:, 1:] == ranks[:, :-1]], dim=1)
        first = at.masked_fill(repeat, 8 * k)  # a repeat's draw position past every first occurrence
        keep = first.topk(k, dim=1, largest=False).values
        order = torch.randperm(vocab, generator=generator)  # the frequent ids anywhere in the vocabulary
        picked = order[draws.gather(1, keep)]
    elif distribution == "uniform":
        picked = torch.randint(0, vocab, (slots, k), generator=generator)
    else:
        raise ValueError(f"distribution {distribution!r}: one of {', '.join(DISTRIBUTIONS)}")
    return torch.cat([picked, torch.randint(0, vocab, (slots, 1), generator=generator)], dim=1)


def csr_table_grad(vocab: int, grad: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [V, rank]: row v the sum of grad[n, c] * x[n] over the (n, c) with ids[n, c] == v, as
    a CSR matrix of the slots' gradients, its rows the candidates sorted by id, times x: each row a
    sum of its own slots, with no two slots adding into one place at once (no host sync: the rows'
    starts come from a search over the sorted ids)."""
    flat = ids.reshape(-1)
    order = flat.argsort()
    starts = torch.searchsorted(flat[order], torch.arange(vocab + 1, device=ids.device))
    with warnings.catch_warnings():  # (sparse CSR tensors are "beta"; these are valid by construction)
        warnings.simplefilter("ignore", UserWarning)
        slots = torch.sparse_csr_tensor(starts, order // ids.shape[1], grad.reshape(-1)[order].float(),
                                        size=(vocab, ids.shape[0]))
        return slots @ x.float()


class _CsrGatherDot(_GatherDot):
    """`gather_dot` with the table's gradient from `csr_table_grad` (the candidate above): the
    trainer's forward, its own backward."""

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, table, ids = ctx.saved_tensors
        rows_sum = compiled_over_rows(_rows_sum, fixed=1) if ctx.compiled else _rows_sum
        return (rows_sum(table, grad, ids).to(x.dtype), csr_table_grad(table.shape[0], grad, x, ids).to(table.dtype),
                None, None)


def spread(ids: torch.Tensor) -> dict:
    """How concentrated the candidates [slots, k] are: distinct ids, and the share of slots holding the
    most frequent one."""
    counts = torch.bincount(ids.flatten().cpu())
    return {"distinct": int((counts > 0).sum()), "top_id_slot_share": float(counts.max()) / ids.shape[0]}


def measure(slots: int, vocab: int, hidden: int, rank: int, k: int, device: torch.device, repeats: int) -> list[dict]:
    compiled = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    left = torch.randn(slots, rank, generator=g).to(device, torch.bfloat16).requires_grad_()
    codebook = (0.02 * torch.randn(vocab, rank, generator=g)).to(device).requires_grad_()
    states = torch.randn(slots, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    head = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    grad = torch.randn(slots, k + 1, generator=g).to(device)
    ops = {"successor codebook (both trained)": (left, codebook, gather_dot),
           "  the same, CSR gradient (no atomics)": (left, codebook, _CsrGatherDot.apply),
           "head rows (frozen head)": (states, head, gather_dot)}
    shape = {"slots": slots, "vocab": vocab, "hidden": hidden, "rank": rank, "k": k, "device": str(device)}
    rows = []
    for distribution in DISTRIBUTIONS:
        ids = candidates(distribution, slots, vocab, k, g).to(device)
        for op, (x, table, reduce) in ops.items():
            def step(x=x, table=table, ids=ids, compiled=compiled, reduce=reduce):
                x.grad = table.grad = None
                (gather_dot(x, table, ids, compiled=compiled) if reduce is gather_dot
                 else reduce(x, table, ids, compiled)).backward(grad)
                return x.grad, table.grad

            # the values against the trainer's eager arithmetic: the compiled kernels', the candidate's
            want = [t.clone() if t is not None else None for t in step(reduce=gather_dot, compiled=False)]
            for w, h in zip(want, step()):
                if (w is None) != (h is None) or (w is not None and not torch.allclose(
                        w.float(), h.float(), rtol=2e-2, atol=2e-2)):
                    raise SystemExit(f"{op.strip()} differs from the eager gather_dot ({distribution}): a bug.")
            rows.append({**shape, **spread(ids[:, :k]), "distribution": distribution, "op": op,
                         "ms": timed(step, device, repeats)})
    base = {r["op"]: r["ms"] for r in rows if r["distribution"] == "zipf"}
    trainer = {r["distribution"]: r["ms"] for r in rows if r["op"].startswith("successor")}
    for r in rows:
        r["vs_zipf"] = r["ms"] / base[r["op"]]
        if "CSR" in r["op"]:
            r["vs_trainer"] = r["ms"] / trainer[r["distribution"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=None, help="scored slots of a step (default: both shapes above)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=4096, help="the drafter's hidden size (the head rows' width)")
    parser.add_argument("--rank", type=int, default=256, help="DFlash2's selector_rank (default 256)")
    parser.add_argument("--k", type=int, default=16, help="DFlash2's selector_top_k (default 16)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file (JSON lines)")
    a = parser.parse_args()
    device = torch.device(a.device)
    shapes = [(a.slots, a.vocab, a.hidden)] if a.slots else list(SHAPES.values())
    results = []
    for slots, vocab, hidden in shapes:
        for r in measure(slots, vocab, hidden, a.rank, a.k, device, a.repeats):
            results.append(r)
            print(f"{r['slots']:>7} slots x {r['vocab']:>7} ids  {r['distribution']:<9} ({r['distinct']:>7,} distinct, "
                  f"the most frequent in {r['top_id_slot_share']:6.1%} of slots)  {r['op']:<34} {r['ms']:8.3f} ms  "
                  f"{r['vs_zipf']:.2f}x zipf" + (f", {r['vs_trainer']:.2f}x the trainer's" if "vs_trainer" in r else ""),
                  flush=True)
    report_rows("selector_grad", device, results, a.json)


if __name__ == "__main__":
    main()

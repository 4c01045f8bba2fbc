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
form's values are checked against the eager one before it is timed.

    python bench/bench_selector_grad.py                  # one GPU: the 8B shape and the small drafter's
    python bench/bench_selector_grad.py --slots 256 --vocab 4096 --hidden 64 --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

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


def spread(ids: torch.Tensor) -> dict:
    """How concentrated the candidates [slots, k] are: distinct ids, and the share of slots holding the
    most frequent one."""
    counts = torch.bincount(ids.flatten().cpu())
    return {"distinct": int((counts > 0).sum()), "top_id_slot_share": float(counts.max()) / ids.shape[0]}


def measure(slots: int, vocab: int, hidden: int, rank: int, k: int, device: torch.device, repeats: int) -> list[dict]:
    from dflash.train.heads.dflash2.kernels import gather_dot

    compiled = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    left = torch.randn(slots, rank, generator=g).to(device, torch.bfloat16).requires_grad_()
    codebook = (0.02 * torch.randn(vocab, rank, generator=g)).to(device).requires_grad_()
    states = torch.randn(slots, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    head = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    grad = torch.randn(slots, k + 1, generator=g).to(device)
    ops = {"successor codebook (both trained)": (left, codebook), "head rows (frozen head)": (states, head)}
    shape = {"slots": slots, "vocab": vocab, "hidden": hidden, "rank": rank, "k": k, "device": str(device)}
    rows = []
    for distribution in DISTRIBUTIONS:
        ids = candidates(distribution, slots, vocab, k, g).to(device)
        for op, (x, table) in ops.items():
            def step(x=x, table=table, ids=ids, compiled=compiled):
                x.grad = table.grad = None
                gather_dot(x, table, ids, compiled=compiled).backward(grad)
                return x.grad, table.grad

            if compiled:  # the compiled kernels' values against the eager arithmetic's
                want = [t.clone() if t is not None else None for t in step(compiled=False)]
                got = step()
                for w, h in zip(want, got):
                    if (w is None) != (h is None) or (w is not None and not torch.allclose(
                            w.float(), h.float(), rtol=2e-2, atol=2e-2)):
                        raise SystemExit(f"gather_dot compiled differs from eager ({op}, {distribution}): a bug.")
            rows.append({**shape, **spread(ids[:, :k]), "distribution": distribution, "op": op,
                         "ms": timed(step, device, repeats)})
    base = {r["op"]: r["ms"] for r in rows if r["distribution"] == "zipf"}
    for r in rows:
        r["vs_zipf"] = r["ms"] / base[r["op"]]
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
                  f"{r['vs_zipf']:.2f}x zipf", flush=True)
    report_rows("selector_grad", device, results, a.json)


if __name__ == "__main__":
    main()

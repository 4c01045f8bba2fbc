"""How the trainer's default held-out split compares with all of a cache's samples, by the
target's own confidence: the mean top-1 probability over each sample's loss tokens (read from
the cache's top-k log-probs), averaged over the held-out samples and over all of them.

    python3 bench/quality/split_proxy.py CACHE_DIR OUT.npz [--fraction 0.02]

prints both means and writes the per-sample figures (with split keys, record groups and the
held-out side) to OUT.npz. A split whose samples the target finds easier than the rest reads a
higher held-out tau than decoding the whole distribution would give (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse

import numpy as np
from dflash.cache_tools.cache_set import CacheSet
from dflash.train.data.heldout import eval_split


def confidence(caches: CacheSet) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean top-1 probability, loss tokens, sample id) per sample, in index order (the top-1
    log-probs read alone, without the hidden states)."""
    n = len(caches)
    p1, tokens = np.zeros(n), np.zeros(n)
    for i, (logprobs, mask) in enumerate(caches.read_top1_logprobs(range(n))):
        if logprobs is None:
            raise SystemExit(f"{caches.manifest.cache_dir} stores no top-k log-probs: extract it with --topk.")
        p1[i], tokens[i] = np.exp(logprobs[mask]).mean() if mask.any() else 0.0, mask.sum()
    return p1, tokens, caches.sample_ids().copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cache")
    ap.add_argument("out")
    ap.add_argument("--fraction", type=float, default=0.02, help="the trainer's --eval-fraction (default 0.02)")
    a = ap.parse_args()
    caches = CacheSet([a.cache], max_seq_len=1 << 20, verify_checksums=False)
    p1, tokens, ids = confidence(caches)
    held = np.zeros(len(caches), bool)
    held[eval_split(caches, a.fraction)[1]] = True
    np.savez(a.out, p1=p1, tokens=tokens, sample_id=ids, keys=caches.split_keys(), grouped=caches.grouped(), held=held)
    held_mean = np.average(p1[held], weights=tokens[held]) if held.any() else float("nan")
    print(f"{a.cache}: {len(caches)} samples, {int(held.sum())} held out; the target's mean top-1 probability "
          f"{np.average(p1, weights=tokens):.4f} over all, {held_mean:.4f} over the held-out ones")


if __name__ == "__main__":
    main()

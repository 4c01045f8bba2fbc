"""Per-sample target confidence of a cache (mean top-1 probability over the loss tokens), with
its split key, held-out side and group: for checking how a held-out split's samples compare
with all of them. Usage: split_proxy.py CACHE_DIR OUT.npz [--fraction 0.02]"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from dflash.cache_tools.cache_set import CacheSet
from dflash.train.heldout import eval_split

ap = argparse.ArgumentParser()
ap.add_argument("cache")
ap.add_argument("out")
ap.add_argument("--fraction", type=float, default=0.02)
a = ap.parse_args()
caches = CacheSet([a.cache], max_seq_len=1 << 20, verify_checksums=False)
n = len(caches)
p1, lp1, hi, tokens, sid = (np.zeros(n) for _ in range(5))
for i in range(n):
    s = caches.read(i)
    m = s["loss_mask"].bool()
    lp = s["topk_logprobs"][:, 0][m].float()
    p1[i], lp1[i], hi[i], tokens[i], sid[i] = lp.exp().mean(), lp.mean(), (lp.exp() > 0.9).float().mean(), m.sum(), s["sample_id"]
_, held = eval_split(caches, a.fraction)
is_held = np.zeros(n, bool)
is_held[held] = True
np.savez(a.out, p1=p1, lp1=lp1, hi=hi, tokens=tokens, sample_id=sid, keys=caches.split_keys(), grouped=caches.grouped(), held=is_held)
print(a.cache, n, "held", is_held.sum(), "p1 all %.4f held %.4f" % (np.average(p1, weights=tokens), np.average(p1[is_held], weights=tokens[is_held]) if is_held.any() else float("nan")))

"""DFlash2's top-K as one Triton kernel (train/heads/dflash2/topk_triton.py): torch.topk's values bit
for bit and ids that hold them, run here through Triton's interpreter on the CPU (its timings are
measured on a GPU: bench/bench_topk_train.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from dflash.train.heads.dflash2 import topk_triton

# Run in a process of its own: Triton reads TRITON_INTERPRET when the kernel is defined (at import).
SCRIPT = textwrap.dedent("""
    import json, torch
    from dflash.train.heads.dflash2 import modules, topk_triton

    torch.manual_seed(0)
    rows = []
    # (rows, vocab, k, dtype, ties): rows past a program's 4, a vocabulary past one tile and not a
    # multiple of it, all-negative rows, k = 4, float16, a row split between 3 programs (few rows, a
    # long vocabulary), and values from a few levels (ties everywhere)
    cases = [(5, 1100, 16, torch.bfloat16, False), (2, 17000, 4, torch.float16, False),
             (6, 600, 16, torch.bfloat16, True)]
    for n, vocab, k, dtype, ties in cases:
        if ties:
            x = torch.randint(-3, 4, (n, vocab)).to(dtype)
        else:  # distinct finite bit patterns of the dtype, half of them negative: distinct values
            bits = torch.stack([torch.randperm(0x7800)[:vocab] + 0x0400 for _ in range(n)])
            sign = (torch.rand(n, vocab) < 0.5).short() * -0x8000
            x = (bits.short() | sign).view(dtype)
        x[0] = -x[0].abs()  # a row of negative values only
        calls = []
        kernel = topk_triton.row_topk
        topk_triton.row_topk = lambda *a: calls.append(1) or kernel(*a)
        values, ids = modules.exact_topk(x, k)  # served by the kernel: DFLASH_TOPK_KERNEL=triton
        topk_triton.row_topk = kernel
        want_values, want_ids = torch.topk(x, k)
        rows.append({"splits": topk_triton._splits(n, vocab), "case": [n, vocab, k, str(dtype), ties], "calls": len(calls),
                     "values": torch.equal(values, want_values), "held": torch.equal(x.gather(-1, ids), values),
                     "distinct": all(len(set(r)) == k for r in ids.tolist()),
                     "ids": torch.equal(ids, want_ids), "shape": list(ids.shape), "id_dtype": str(ids.dtype)})
    print(json.dumps(rows))
""")


def test_the_kernel_gives_torch_topks_values_and_ids_that_hold_them():
    env = {**os.environ, "TRITON_INTERPRET": "1", "DFLASH_TOPK_KERNEL": "triton"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for row in rows:
        assert row["calls"] == 1, row  # exact_topk handed the rows to the kernel
        assert row["values"] and row["held"] and row["distinct"], row
        assert row["shape"] == row["case"][:1] + row["case"][2:3] and row["id_dtype"] == "torch.int64", row
    assert rows[0]["ids"] and rows[1]["ids"]  # distinct values: torch.topk's ids exactly
    assert [row["splits"] for row in rows] == [1, 3, 1]  # the second row's ids in three programs, merged


def test_the_kernel_serves_16_bit_cuda_logits_when_asked_for(monkeypatch):
    if topk_triton.triton is None or not hasattr(topk_triton.tl, "topk"):
        pytest.skip("Triton with tl.topk is not installed (the dev extra installs it)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DFLASH_TOPK_KERNEL", raising=False)

    def cuda(dtype=torch.bfloat16, vocab=8192):  # what `available` reads of a CUDA tensor
        return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=(7, vocab))

    assert not topk_triton.available(cuda(), 16)  # not asked for: the two-stage top-K
    monkeypatch.setenv("DFLASH_TOPK_KERNEL", "triton")
    assert topk_triton.available(cuda(), 16)
    assert topk_triton.available(cuda(torch.float16), 4)
    assert not topk_triton.available(cuda(torch.float32), 16)  # float32 logits: no 16-bit key
    assert not topk_triton.available(cuda(), 12)  # Triton's top-k takes a power of two
    assert not topk_triton.available(cuda(vocab=8), 16)  # a row shorter than k
    assert not topk_triton.available(torch.zeros(2, 64, dtype=torch.bfloat16), 16)  # a CPU tensor

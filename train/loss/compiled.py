"""The head loss's compiled kernels made once per process: the chunk function
(train/loss/head_loss.py) and DFlash2's gather-reductions (train/heads/dflash2/kernels.py)."""

from __future__ import annotations

import torch

_COMPILED: dict = {}  # each function's compiled form


def compiled_over_rows(fn, fixed: int = 0):
    """`fn` compiled once (per process): dim 0 of each tensor argument after the first `fixed` (the
    rows: slots or a chunk's rows, which vary from step to step) symbolic from the first call, the
    rest static, so that inductor knows the reductions' lengths (a vocabulary, a row of 384 or 4,096
    values, the K + 1 candidates), where symbolic lengths make every reduction a loop."""
    if fn not in _COMPILED:
        compiled = torch.compile(fn)

        def call(*args):
            for arg in args[fixed:]:
                if isinstance(arg, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
            return compiled(*args)
        _COMPILED[fn] = call
    return _COMPILED[fn]

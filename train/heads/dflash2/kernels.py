"""The selector's gather-reductions without their gathered rows: `gather_dot(x, table, ids)` is
`(table[ids] * x[:, None]).sum(-1)` (the candidates' logits from the head's rows, the edges from the
successor codebook's), whose forward and backward are each one compiled kernel that reads the rows
where it needs them instead of writing [N, C, D] gathered copies (1 to 4 GB a step at the shapes
bench/profile_step.py measures) and reading them back.

Used by `selector_objective` when the drafter is compiled and on CUDA (train/loss/objective.py); the
eager path (modules.py, head_loss.candidate_logits) computes the same sums. Compiled as the head
loss's chunk function is (train/loss/compiled.py).
"""

from __future__ import annotations

import torch
from dflash.train.loss.compiled import compiled_over_rows


def _dot(table: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (table[ids].float() * x.float()[:, None, :]).sum(-1)


def _rows_sum(table: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (grad.float()[:, :, None] * table[ids].float()).sum(1)


def _table_grad(table: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """d/d table (float32, the table's shape): row ids[n, c] gathers grad[n, c] * x[n], summed over
    repeats (a scatter-add)."""
    out = torch.zeros(table.shape, dtype=torch.float32, device=x.device)
    update = grad.float()[:, :, None] * x.float()[:, None, :]
    return out.index_put_((ids.reshape(-1),), update.reshape(-1, x.shape[-1]), accumulate=True)


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table, ids, compiled):  # noqa: D102 - see gather_dot
        ctx.save_for_backward(x, table, ids)
        ctx.compiled = compiled
        return (compiled_over_rows(_dot, fixed=1) if compiled else _dot)(table, x, ids)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, table, ids = ctx.saved_tensors
        rows_sum = compiled_over_rows(_rows_sum, fixed=1) if ctx.compiled else _rows_sum
        table_grad = compiled_over_rows(_table_grad, fixed=1) if ctx.compiled else _table_grad
        grad_x = rows_sum(table, grad, ids).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_table = table_grad(table, grad, x, ids).to(table.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_table, None, None


def gather_dot(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """float32 [N, C]: `<table[ids[n, c]], x[n]>` for x [N, D], table [V, D], ids [N, C], differentiable
    in x and in the table (where it needs a gradient), products and sums in float32; `compiled`: each
    direction one torch.compile'd kernel (CUDA), else eager (the same arithmetic, with the gathered rows)."""
    return _GatherDot.apply(x, table, ids, compiled)

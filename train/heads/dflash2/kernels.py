"""The selector's gather-reductions without their gathered rows: `gather_dot(x, table, ids)` is
`(table[ids] * x[:, None]).sum(-1)` (the candidates' logits from the head's rows, the edges from the
successor codebook's), whose forward and backward are each one compiled kernel that reads the rows
where it needs them instead of writing [N, C, D] gathered copies (1 to 4 GB a step at the shapes
bench/profile_step.py measures) and reading them back.

Used by `selector_objective` when the drafter is compiled and on CUDA (train/loss/objective.py); the
eager path (modules.py, head_loss.candidate_logits) computes the same sums.
"""

from __future__ import annotations

import torch

_COMPILED: dict[str, object] = {}


def _dot(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (table[ids].float() * x.float()[:, None, :]).sum(-1)


def _rows_sum(grad: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (grad.float()[:, :, None] * table[ids].float()).sum(1)


def _table_grad(grad: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """d/d table: row ids[n, c] gathers grad[n, c] * x[n], summed over repeats (a scatter-add)."""
    out = torch.zeros((rows, x.shape[-1]), dtype=torch.float32, device=x.device)
    update = grad.float()[:, :, None] * x.float()[:, None, :]
    return out.index_put_((ids.reshape(-1),), update.reshape(-1, x.shape[-1]), accumulate=True)


def _compiled(name: str, fn):
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table, ids, compiled):  # noqa: D102 - see gather_dot
        ctx.save_for_backward(x, table, ids)
        ctx.compiled = compiled
        run = _compiled("dot", _dot) if compiled else _dot
        return run(x, table, ids)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, table, ids = ctx.saved_tensors
        rows_sum = _compiled("rows_sum", _rows_sum) if ctx.compiled else _rows_sum
        table_grad = _compiled("table_grad", _table_grad) if ctx.compiled else _table_grad
        grad_x = rows_sum(grad, table, ids).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_table = table_grad(grad, x, ids, table.shape[0]).to(table.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_table, None, None


def gather_dot(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """float32 [N, C]: `<table[ids[n, c]], x[n]>` for x [N, D], table [V, D], ids [N, C], differentiable
    in x and in the table (where it needs a gradient), products and sums in float32; `compiled`: each
    direction one torch.compile'd kernel (CUDA), else eager (the same arithmetic, with the gathered rows)."""
    return _GatherDot.apply(x, table, ids, compiled)

"""DFlash2's in-block convolution as two Triton kernels on CUDA: the forward, and a backward that
gives the input's, the offsets' and the base taps' gradients in one pass over the output's gradient.

`out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c]` over the taps t whose
token i - t lies in token i's block (modules._InBlockConv's arithmetic). Compiled by inductor, the
same expression runs as several kernels a direction, each a pass over the [tokens, hidden]
activations (a shifted read, each tap's products, their group and token sums); here each direction
reads x, the gradient and the offsets once and writes its results once. Products and sums are
float32 (the expression's are in the activations' dtype); results in the activations' dtype, the
base taps' gradient float32, summed over the token tiles' partial sums.

Registered as custom operators, so that a compiled drafter keeps them as one opaque call each.
`available(...)` says where they apply: asked for (DFLASH_CONV_KERNEL=triton), CUDA tensors, Triton
importable, a power-of-two group.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: modules._InBlockConv computes the expression itself
    triton = None

TOKENS_PER_TILE = 32
CHANNELS_PER_TILE = 64  # the narrowest channel tile tried: a group must fit in it


def available(x: torch.Tensor, group_size: int) -> bool:
    """Whether the kernels serve `x` (the grouped activations) with `group_size`-channel groups:
    DFLASH_CONV_KERNEL=triton (until a GPU measures them faster, the compiled expression is the
    default), CUDA tensors (any tensor under Triton's interpreter) and a power-of-two group."""
    return (triton is not None and os.environ.get("DFLASH_CONV_KERNEL", "torch") == "triton"
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and group_size & (group_size - 1) == 0 and group_size <= CHANNELS_PER_TILE)


if triton is not None:
    # The channel tile and the warps a program takes, tried once per hidden size (the first step's)
    _TILES = [triton.Config({"BC": bc}, num_warps=w) for bc in (64, 128, 256) for w in (4, 8)]
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no timer: one tile
        _TILES = _TILES[:1]

    @triton.autotune(_TILES, key=["hidden", "TAPS"])
    @triton.jit
    def _forward_kernel(x, delta, base, out, tokens, length, hidden, block_size, group_size,
                        d_token, d_tap, d_group, TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        row_ok, col_ok = rows < tokens, cols < hidden
        slot = (rows % length) % block_size
        group = cols // group_size
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for t in tl.static_range(TAPS):
            ok = (row_ok & (slot >= t))[:, None] & col_ok[None, :]
            earlier = tl.load(x + (rows - t)[:, None] * hidden + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            offset = tl.load(delta + rows[:, None] * d_token + t * d_tap + group[None, :] * d_group, mask=ok,
                             other=0.0).to(tl.float32)
            tap = tl.load(base + t * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += (tap[None, :] + offset) * earlier
        keep = row_ok[:, None] & col_ok[None, :]
        tl.store(out + rows[:, None] * hidden + cols[None, :], acc.to(out.dtype.element_ty), mask=keep)

    @triton.autotune(_TILES, key=["hidden", "TAPS"])  # every output is written whole: a rerun is safe
    @triton.jit
    def _backward_kernel(grad, x, delta, base, grad_x, grad_delta, base_partial, tokens, length, hidden,
                         block_size, groups, d_token, d_tap, d_group, TAPS: tl.constexpr, GROUP: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
        tile = tl.program_id(0)
        rows = tile * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        row_ok, col_ok = rows < tokens, cols < hidden
        position = rows % length
        slot = position % block_size
        group = cols // GROUP
        here = row_ok[:, None] & col_ok[None, :]
        g = tl.load(grad + rows[:, None] * hidden + cols[None, :], mask=here, other=0.0).to(tl.float32)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        out_groups = tl.program_id(1) * (BC // GROUP) + tl.arange(0, BC // GROUP)
        for t in tl.static_range(TAPS):
            tap = tl.load(base + t * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
            # token i + t of the same block read token i at tap t: its gradient comes back to token i
            later_ok = (row_ok & (slot + t < block_size) & (position + t < length))[:, None] & col_ok[None, :]
            later = tl.load(grad + (rows + t)[:, None] * hidden + cols[None, :], mask=later_ok, other=0.0).to(tl.float32)
            offset = tl.load(delta + (rows + t)[:, None] * d_token + t * d_tap + group[None, :] * d_group,
                             mask=later_ok, other=0.0).to(tl.float32)
            acc += later * (tap[None, :] + offset)
            # d out[i] / d (base[t] + delta[i, t]) = x[i - t] in its block
            earlier_ok = (row_ok & (slot >= t))[:, None] & col_ok[None, :]
            earlier = tl.load(x + (rows - t)[:, None] * hidden + cols[None, :], mask=earlier_ok,
                              other=0.0).to(tl.float32)
            product = g * earlier
            by_group = tl.sum(tl.reshape(product, (BT, BC // GROUP, GROUP)), axis=2)
            tl.store(grad_delta + rows[:, None] * (TAPS * groups) + t * groups + out_groups[None, :],
                     by_group, mask=row_ok[:, None] & (out_groups < groups)[None, :])
            tl.store(base_partial + tile * (TAPS * hidden) + t * hidden + cols, tl.sum(product, axis=0),
                     mask=col_ok)
        tl.store(grad_x + rows[:, None] * hidden + cols[None, :], acc.to(grad_x.dtype.element_ty), mask=here)


def _grid(tokens: int, hidden: int):
    return lambda meta: (triton.cdiv(tokens, TOKENS_PER_TILE), triton.cdiv(hidden, meta["BC"]))


def _flat(x: torch.Tensor, delta: torch.Tensor):
    """x as [N, D] (contiguous), delta as [N, taps, G] (a view where it can be), N = B * Q."""
    batch, length, groups, group_size = x.shape
    return x.reshape(batch * length, groups * group_size).contiguous(), delta.reshape(batch * length, *delta.shape[2:])


@torch.library.custom_op("dflash::in_block_conv", mutates_args=())
def in_block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """`out` [B, Q, G, gs] of x [B, Q, G, gs], delta [B, Q, taps, G], base [taps, G, gs]."""
    batch, length, groups, group_size = x.shape
    flat, offsets = _flat(x, delta)
    out = torch.empty_like(flat)
    taps = base.shape[0]
    _forward_kernel[_grid(*flat.shape)](
        flat, offsets, base.contiguous(), out, flat.shape[0], length, flat.shape[1], block_size, group_size,
        offsets.stride(0), offsets.stride(1), offsets.stride(2), TAPS=taps, BT=TOKENS_PER_TILE)
    return out.view(x.shape)


@in_block_conv.register_fake
def _(x, delta, base, block_size):
    return x.new_empty(x.shape)


@torch.library.custom_op("dflash::in_block_conv_backward", mutates_args=())
def in_block_conv_backward(grad: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d x, d delta, d base) of `in_block_conv` for the output's gradient `grad`."""
    batch, length, groups, group_size = x.shape
    flat, offsets = _flat(x, delta)
    grad_flat = grad.reshape(flat.shape).contiguous()
    tokens, hidden = flat.shape
    taps = base.shape[0]
    grad_x = torch.empty_like(flat)
    grad_delta = torch.empty(tokens, taps, groups, dtype=torch.float32, device=x.device)
    partial = torch.empty(triton.cdiv(tokens, TOKENS_PER_TILE), taps, hidden, dtype=torch.float32, device=x.device)
    _backward_kernel[_grid(tokens, hidden)](
        grad_flat, flat, offsets, base.contiguous(), grad_x, grad_delta, partial, tokens, length, hidden,
        block_size, groups, offsets.stride(0), offsets.stride(1), offsets.stride(2), TAPS=taps, GROUP=group_size,
        BT=TOKENS_PER_TILE)
    return (grad_x.view(x.shape), grad_delta.view(delta.shape).to(delta.dtype),
            partial.sum(0).view(base.shape).to(base.dtype))


@in_block_conv_backward.register_fake
def _(grad, x, delta, base, block_size):
    return x.new_empty(x.shape), delta.new_empty(delta.shape), base.new_empty(base.shape)


def _setup(ctx, inputs, output):
    x, delta, base, block_size = inputs
    ctx.save_for_backward(x, delta, base)
    ctx.block_size = block_size


def _backward(ctx, grad):
    x, delta, base = ctx.saved_tensors
    grad_x, grad_delta, grad_base = in_block_conv_backward(grad, x, delta, base, ctx.block_size)
    return grad_x, grad_delta, grad_base, None


in_block_conv.register_autograd(_backward, setup_context=_setup)

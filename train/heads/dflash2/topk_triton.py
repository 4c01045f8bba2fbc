"""DFlash2's top-K candidates as one Triton kernel on CUDA: each row of 16-bit logits read once.

`modules.exact_topk` takes the K largest of a row in two stages (the maxima of segments, then
`torch.topk` over the best segments' ids), three launches and two passes. Here a program holds a
few rows and walks their vocabulary in tiles: each logit and its id within the tile packed in one
int32 whose order is the logit's (the 16 bits of a bf16 or float16 value, made order-preserving,
above the complement of the id within the tile, so that of equal values the lower id wins), the
tile's K best by Triton's bitonic top-k, then merged into the row's running K best as int64 keys
(value above the complement of the id in the row). Where rows are few (a chunk of a 151,936-id
head's rows) each row's ids are split between programs, whose K best each one `torch.topk` over
int64 keys merges. Values come back bit for bit; ids are torch.topk's where the values hold no tie
at the K-th.

Registered as a custom operator, so that a compiled drafter keeps it as one opaque call.
`available(...)` says where it applies: asked for (DFLASH_TOPK_KERNEL=triton), CUDA tensors, a
16-bit dtype, a power-of-two K, Triton with `tl.topk`.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: modules.exact_topk serves
    triton = None

ROWS_PER_PROGRAM = 4
MAX_BV = 2048  # the widest tile of ids tried (the id within a tile takes a key's low 16 bits)


def available(scores: torch.Tensor, k: int) -> bool:
    """Whether the kernel serves the top-`k` of `scores` [..., V]: DFLASH_TOPK_KERNEL=triton (until a
    GPU measures it faster, the two-stage top-K is the default), CUDA tensors (any tensor under
    Triton's interpreter), bf16 or float16, a power-of-two k no wider than a row."""
    return (triton is not None and hasattr(tl, "topk")
            and os.environ.get("DFLASH_TOPK_KERNEL", "torch") == "triton"
            and (scores.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and scores.dtype in (torch.bfloat16, torch.float16)
            and 0 < k <= scores.shape[-1] and k & (k - 1) == 0)


if triton is not None:
    # The tile of ids and the warps, tried once per (vocabulary, k)
    _TILES = [triton.Config({"BV": bv}, num_warps=w) for bv in (512, 1024, MAX_BV) for w in (4, 8)]
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no timer: one tile
        _TILES = _TILES[:1]

    @triton.jit
    def _ordered(bits):
        """int16 bits of a float -> an int16 of the same order (negative values' magnitude flipped)."""
        return tl.where(bits < 0, bits ^ 0x7FFF, bits)

    @triton.autotune(_TILES, key=["vocab", "span", "K"])
    @triton.jit
    def _topk_kernel(scores, keys, rows, vocab, stride, span, K: tl.constexpr, BR: tl.constexpr,
                     BV: tl.constexpr):
        """keys [rows, splits, K] int64: the K best of each row's `span` ids of split program_id(1)."""
        row = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = row < rows
        split = tl.program_id(1)
        local = tl.arange(0, BV)
        best = tl.full((BR, K), -(2**63), tl.int64)
        for start in range(split * span, tl.minimum(vocab, (split + 1) * span), BV):
            col = start + local
            ok = row_ok[:, None] & (col < vocab)[None, :]
            x = tl.load(scores + row[:, None].to(tl.int64) * stride + col[None, :], mask=ok, other=0.0)
            order = _ordered(x.to(tl.int16, bitcast=True)).to(tl.int32)
            key = tl.where(ok, (order << 16) | (0xFFFF - local)[None, :], -(2**31))
            tile = tl.topk(key, K)  # [BR, K] int32, best first
            at = start + 0xFFFF - (tile & 0xFFFF)
            wide = ((tile >> 16).to(tl.int64) << 32) | (0x7FFFFFFF - at).to(tl.int64)
            wide = tl.where(tile == -(2**31), -(2**63), wide)  # a masked tail's filler stays below all
            best = tl.topk(tl.reshape(tl.join(best, wide), (BR, 2 * K)), K)
        slot = tl.arange(0, K)
        splits = tl.num_programs(1)
        tl.store(keys + (row[:, None].to(tl.int64) * splits + split) * K + slot[None, :], best,
                 mask=row_ok[:, None] & (slot < K)[None, :])


def _splits(rows: int, vocab: int) -> int:
    """Programs a row: enough programs to fill a GPU (about 1,024) where rows are few, each over at
    least 8,192 ids."""
    programs = -(-rows // ROWS_PER_PROGRAM)
    return max(1, min(-(-vocab // 8192), -(-1024 // max(programs, 1))))


@torch.library.custom_op("dflash::row_topk", mutates_args=())
def row_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [..., k] of the k largest of `scores` [..., V], best first (see the module)."""
    vocab = scores.shape[-1]
    flat = scores.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    splits = _splits(rows, vocab)
    span = triton.cdiv(triton.cdiv(vocab, splits), MAX_BV) * MAX_BV  # a multiple of every tile
    keys = torch.empty(rows, splits, k, dtype=torch.long, device=scores.device)
    if rows:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), splits)
        _topk_kernel[grid](flat, keys, rows, vocab, flat.stride(0), span, K=k, BR=ROWS_PER_PROGRAM)
    keys = keys.view(rows, splits * k)
    if splits > 1:  # the splits' K best each, merged
        keys = torch.topk(keys, k, dim=-1).values
    order = (keys >> 32).to(torch.int16)
    values = torch.where(order < 0, order ^ 0x7FFF, order).view(scores.dtype)
    ids = 0x7FFFFFFF - (keys & 0xFFFFFFFF)
    lead = scores.shape[:-1]
    return values.view(*lead, k), ids.view(*lead, k)


@row_topk.register_fake
def _(scores, k):
    shape = (*scores.shape[:-1], k)
    return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.long)

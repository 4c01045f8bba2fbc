"""Helpers shared by the cache tests: tiny headers and random samples."""

from __future__ import annotations

import numpy as np
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import make_header
from dflash.cache_tools.writer import CacheWriter


def tiny_header(codec: str = "bf16", *, layers=(1, 3), hidden_size: int = 32, chunk_rows: int = 16,
                shard_rows: int = 64, **kw) -> dict:
    return make_header(
        target={"path": "tiny-target", "config_hash": "0" * 64, "architecture": "Qwen3ForCausalLM",
                "hidden_size": hidden_size, "num_hidden_layers": 4, "vocab_size": 128},
        target_layer_ids=list(layers), hidden_size=hidden_size, codec=HiddenCodec(name=codec),
        chunk_rows=chunk_rows, shard_rows=shard_rows, **kw,
    )


def random_sample(gen: torch.Generator, length: int, width: int, *, outliers: bool = True):
    """(input_ids, loss_mask, hidden bf16 [length, width]) with a few large channels."""
    hidden = torch.randn(length, width, generator=gen)
    if outliers:
        hidden[:, :: max(1, width // 7)] *= 40.0
    ids = torch.randint(0, 128, (length,), generator=gen)
    mask = torch.randint(0, 2, (length,), generator=gen)
    return ids, mask, hidden.to(torch.bfloat16)


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """The bf16 bits of a tensor or of a reader's decoded rows (uint16), as int16."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view(np.int16)
    return x.contiguous().view(torch.int16).numpy()


def make_cache(path, codec="bf16", parts=2, length=100):
    """A cache of `parts` parts of two samples of `length` rows (width 64, K=2 x D=32,
    16-row chunks, 64-row shards); returns the samples written, in order."""
    writer = CacheWriter(path, tiny_header(codec))
    gen = torch.Generator().manual_seed(0)
    samples = []
    for p in range(parts):
        with writer.part_writer(f"part-{p:06d}") as pw:
            for s in range(2):
                sample = random_sample(gen, length, 64)
                pw.add_sample(p * 10 + s, *sample)
                samples.append(sample)
    return samples


def shard_file(cache, part, shard=0):
    return cache / "parts" / part / "hidden" / "c" / str(shard) / "0"

"""What a cache holds, from its manifest alone: the summary `dflash-cache info` prints.

No part is opened and neither torch nor the reader is imported, so it is instant on any cache
size and starts in the time it takes to read the manifest.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .eviction import EvictionLog
from .manifest import Manifest, read_manifest
from .plan import unfinished_extraction
from .sample_scores import top1_selected
from .schema import PartSchema


def raw_bf16_bytes(manifest: Manifest) -> int:
    """Size the stored activations would have as plain bf16 (the reference for ratios)."""
    schema = PartSchema.from_header(manifest.header)
    per_token = sum(schema.value_width(spec.name) * 2 for spec in schema.hidden_arrays())
    return manifest.num_tokens * per_token


def top1_samples(manifest: Manifest) -> int | None:
    """How many samples hold the target's top-1 (every one below share 1, by split key, else
    sample id, from the commit records); None where a record predates its sample ids."""
    share = manifest.top1_share
    if share >= 1 or share <= 0:
        return manifest.num_samples if share >= 1 else 0
    if any(p.sample_ids is None and p.split_keys is None for p in manifest.parts):
        return None
    keys = np.array([k for p in manifest.parts for k in (p.sample_ids if p.split_keys is None else p.split_keys)],
                    dtype=np.int64)
    return int(top1_selected(keys, share).sum())


def _codec_history(producer: dict[str, Any]) -> list[str]:
    if producer.get("codec_history"):
        return list(producer["codec_history"])
    earlier = producer.get("recompressed_from")
    return [earlier["name"]] if isinstance(earlier, dict) and "name" in earlier else []


def cache_info(cache_dir: str | os.PathLike) -> dict[str, Any]:
    """Summary of a cache from its manifest alone (no part is opened)."""
    m = read_manifest(cache_dir)
    evicted = EvictionLog(m.cache_dir).refresh().evicted()  # under a disk budget (eviction.py)
    nbytes = m.nbytes
    raw = raw_bf16_bytes(m)
    lengths = np.concatenate([np.asarray(p.lengths, np.int64) for p in m.parts]) if m.parts else np.zeros(0, np.int64)
    part_stats: dict[str, float] = {}
    for p in m.parts:
        for key, value in p.stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                part_stats[key] = part_stats.get(key, 0) + value
    return {
        "cache_dir": str(m.cache_dir),
        "format_version": m.header["format_version"],
        "target": m.header["target"],
        # where the target was read from; older headers kept it as target.path
        "provenance": m.header.get("provenance") or ({"target_path": m.header["target"]["path"]}
                                                     if "path" in m.header["target"] else {}),
        "target_layer_ids": m.target_layer_ids,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "codec": m.codec.to_dict(),
        # the codecs a recompress wrote it from, oldest first (empty: written by an extraction)
        "codec_history": _codec_history(m.header.get("producer") or {}),
        "chunk_rows": m.chunk_rows,
        "shard_rows": m.shard_rows,
        "extras": m.header["extras"],
        "top1_share": m.top1_share,
        "top1_samples": top1_samples(m),
        "data": m.header.get("data", {}),
        "settings": m.header.get("settings", {}),
        "parts": len(m.parts),
        "samples": m.num_samples,
        "tokens": m.num_tokens,
        "sample_length": {
            "min": int(lengths.min()) if lengths.size else 0,
            "mean": float(lengths.mean()) if lengths.size else 0.0,
            "max": int(lengths.max()) if lengths.size else 0,
        },
        "bytes": nbytes,
        "bytes_per_token": nbytes / m.num_tokens if m.num_tokens else 0.0,
        "raw_bf16_bytes": raw,
        "compression_ratio": raw / nbytes if nbytes else 0.0,
        "part_stats": part_stats,
        "evicted_parts": sorted(evicted),
        "evicted_bytes": sum(st.nbytes for st in evicted.values()),
        # the extraction's plan promises more parts than are committed (stopped, running, a lost rank)
        "unfinished": None if (left := unfinished_extraction(m.cache_dir, m.header, {p.name for p in m.parts})) is None
        else {"planned_parts": left.planned, "planned_samples": left.planned_samples},
    }

"""What the drafter borrows from its target: configuration, frozen embedding, lm_head, final norm.

The target checkpoint is never loaded whole: only the few tensors the drafter needs are read
from its safetensors files (single file or sharded with `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools.layers import default_target_layer_ids
from dflash.runtime.errors import InputError, MismatchError
from dflash.runtime.findings import Finding
from dflash.runtime.safetensors_files import check_weight_dir, refuse_drafter_as_target
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# The layer rule is part of the cache contract; the drafter config reads it from here.
__all__ = ["TargetWeights", "default_target_layer_ids", "load_target_config", "load_target_weights"]


class TargetFilesError(InputError, FileNotFoundError):
    """The target directory lacks a file or tensor the drafter reads (a FileNotFoundError, as the
    callers that name the target catch)."""


class TargetUnreadableError(InputError, ValueError):
    """The target's config or tokenizer cannot be read for what the drafter needs of it."""


class TargetMismatchError(MismatchError, ValueError):
    """The drafter and the target (or the hidden states captured from it) do not have the same shape."""


def load_target_config(target_dir: str | Path) -> Any:
    """The target's text config (a transformers PretrainedConfig), read from disk only."""
    from transformers import AutoConfig

    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise TargetFilesError(Finding("train.target-no-config", dir=str(target_dir)))
    refuse_drafter_as_target(target_dir)
    config = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    # Multimodal wrappers keep the decoder's dimensions in a text sub-config.
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class TargetWeights:
    """Frozen tensors taken from the target checkpoint."""

    embed_tokens: torch.Tensor
    """[vocab, hidden] input embedding."""
    lm_head: torch.Tensor
    """[vocab, hidden] output projection (the embedding itself for tied targets)."""
    final_norm: torch.Tensor | None = None
    """[hidden] weight of the target's final RMSNorm; only needed for soft labels."""


def tensor_locations(target_dir: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file that holds it."""
    index = target_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / fname for name, fname in weight_map.items()}
    files = [target_dir / SAFETENSORS_SINGLE] if (target_dir / SAFETENSORS_SINGLE).is_file() else (
        sorted(target_dir.glob("*.safetensors"))
    )
    if not files:
        pickled = any(target_dir.glob("*.bin")) or any(target_dir.glob("*.pt"))
        raise TargetFilesError(Finding("train.target-no-safetensors", dir=str(target_dir), pickled=pickled))
    locations: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                locations[name] = path
    return locations


def _pick(names: list[str], pattern: str) -> str | None:
    """The shortest tensor name matching `pattern` (prefers `model.x` over `mtp.model.x`)."""
    regex = re.compile(pattern)
    hits = sorted((n for n in names if regex.search(n)), key=lambda n: (len(n), n))
    return hits[0] if hits else None


def load_target_weights(
    target_dir: str | Path, *, tie_word_embeddings: bool | None = None, with_final_norm: bool = False
) -> TargetWeights:
    """Read the embedding, lm_head (and optionally the final norm) from the target's safetensors.

    Names are matched by suffix so that `model.embed_tokens.weight`,
    `model.language_model.embed_tokens.weight` or a bare `embed_tokens.weight` all work. A
    missing `lm_head.weight` falls back to the embedding when the target ties them.
    """
    target_dir = Path(target_dir)
    check_weight_dir(target_dir, purpose="target")
    if tie_word_embeddings is None:
        tie_word_embeddings = bool(getattr(load_target_config(target_dir), "tie_word_embeddings", False))
    locations = tensor_locations(target_dir)
    names = list(locations)
    embed_name = _pick(names, r"(^|\.)embed_tokens\.weight$")
    head_name = _pick(names, r"(^|\.)lm_head\.weight$")
    norm_name = _pick([n for n in names if ".layers." not in n], r"(^|\.)norm\.weight$")
    if embed_name is None:
        raise TargetFilesError(Finding("train.target-no-embedding", dir=str(target_dir)))
    if head_name is None and not tie_word_embeddings:
        raise TargetFilesError(Finding("train.target-no-lm-head", dir=str(target_dir)))
    if with_final_norm and norm_name is None:
        raise TargetFilesError(Finding("train.target-no-final-norm", dir=str(target_dir), tensor="norm.weight"))

    def read(name: str) -> torch.Tensor:
        path = locations[name]
        if not path.is_file():
            raise TargetFilesError(Finding("train.target-shard-missing", shard=path.name,
                                           index=str(target_dir / SAFETENSORS_INDEX)))
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)

    embed = read(embed_name)
    head = read(head_name) if head_name is not None else embed
    norm = read(norm_name) if with_final_norm else None
    return TargetWeights(embed_tokens=embed, lm_head=head, final_norm=norm)

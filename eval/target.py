"""The engine's dealings with a Hugging Face target: its KV cache and forward pass across
transformers versions, undoing a verify pass in caches that cropping cannot undo, the captured
hidden states the drafter reads, and the left-padded prompts a batch starts from."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from dflash.runtime.errors import EnvironmentFault
from dflash.runtime.findings import Finding

from .config import EvalError


def capture_hidden(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """[B, n, K*D] concat of the captured layers (id l = HF `hidden_states[l + 1]`)."""
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


def crop_kv(cache: Any, remove: int) -> None:
    """Drop the last `remove` columns of an HF cache.

    `crop(-n)` removes n columns in transformers 4.57 and 5.x alike; `crop(0)` would empty
    the cache in 4.57, so it is never called with 0.
    """
    if remove > 0:
        cache.crop(-remove)


def forward_with_cache(model: Any, cache: Any, **inputs: Any) -> Any:
    """One target pass over `cache` (the keyword is `cache` in transformers >= 5.2x,
    `past_key_values` before)."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    return model(**inputs, **{key: cache}, use_cache=True)


def new_kv_cache(model: Any) -> Any:
    """An empty transformers KV cache for `model` (DynamicCache, with its config where it takes one)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x takes no config
        return DynamicCache()
    layers = getattr(cache, "layers", [])
    if any(getattr(layer, "is_sliding", False) and not hasattr(layer, "activate_past_recording") for layer in layers):
        # transformers 4.57: sliding layers cannot be cropped once past their window, full
        # ones can; the attention mask applies the window either way.
        return DynamicCache()
    return cache


def _has_sliding_layers(config: Any) -> bool:
    """Whether the target's config gives any layer a sliding window (whatever its cache holds)."""
    if config is None or getattr(config, "sliding_window", None) is None:
        return False
    types = getattr(config, "layer_types", None)
    return types is None or "sliding_attention" in types


class TargetUnbatchableError(EvalError, ValueError):
    """The target's sliding-window or linear-attention layers count cache columns: speculative
    decoding of it takes one prompt per batch (--batch-size 1)."""


class RollbackUnsupportedError(EnvironmentFault, ValueError):
    """This transformers cannot roll a sliding-window cache back after rejected drafts."""


class TargetStateRollback:
    """Undoing a verify pass in target caches that cropping alone cannot undo.

    Sliding-window layers keep only their window unless asked to record the past (then a crop
    works); linear-attention layers (Qwen3.5's gated delta rule) fold every token into a
    recurrent state, so their state from before the verify pass is kept aside and restored, and
    the accepted tokens are run through the target again. Both count a window or a recurrence
    in cache columns, which holes would break: such targets are decoded one sequence per batch.
    """

    def __init__(self, cache: Any, batch: int, config: Any = None) -> None:
        layers = list(getattr(cache, "layers", []))
        self.recurrent = [i for i, layer in enumerate(layers) if hasattr(layer, "recurrent_states")]
        sliding = [layer for layer in layers if getattr(layer, "is_sliding", False)]
        if (sliding or self.recurrent or _has_sliding_layers(config)) and batch > 1:
            kind = "linear-attention" if self.recurrent else "sliding-window"
            raise TargetUnbatchableError(Finding("eval.target-unbatchable", layers=kind, flag="--batch-size",
                                                 value=batch))
        for layer in sliding:
            if not hasattr(layer, "activate_past_recording"):
                import transformers

                raise RollbackUnsupportedError(Finding("eval.transformers-too-old", version=transformers.__version__,
                                                       needed="5"))
            layer.activate_past_recording()

    def snapshot(self, cache: Any) -> dict[int, Any] | None:
        return {i: copy.deepcopy(cache.layers[i]) for i in self.recurrent} if self.recurrent else None

    def restore(self, cache: Any, snapshot: dict[int, Any], width: int) -> None:
        """The cache as before a verify pass over `width` tokens."""
        for i, layer in enumerate(cache.layers):
            if i in snapshot:
                cache.layers[i] = snapshot[i]
            else:
                layer.crop(-width)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, N] and 0/1 mask [B, N]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)

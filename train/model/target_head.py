"""The target's own output head for soft labels, and the choice of the drafter's mask token.

Soft labels from `last_hidden` need the target's logits, `head(final_norm(x))` plus whatever its
causal-LM forward does after the head. Families differ there: Qwen3.5's final norm is
zero-centred (`(1 + w) * x_hat`), Gemma's too, Gemma 2/3 soft-cap the logits, Cohere scales
them, Granite divides them. So the final norm is not re-implemented: it is the target's own
transformers module, instantiated from its config (on the meta device, so nothing else of the
model is built) and filled with the checkpoint's tensors; the lm_head is the drafter's frozen
copy of the target's head, and the post-head steps are read from the config (runtime/logits.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.runtime.findings import Finding
from dflash.runtime.logits import apply_post_head, post_head_steps
from dflash.train.model.target_weights import (
    TargetFilesError,
    TargetUnreadableError,
    load_target_config,
    tensor_locations,
)
from safetensors import safe_open
from torch import nn

# Checkpoint prefixes that hold a second copy of a norm (multi-token-prediction heads, vision towers).
_NOT_THE_DECODER = ("mtp.", "visual.", "vision_tower.", "vision_model.", "audio_tower.")


class TargetHead:
    """Logits of the target from its final pre-norm hidden state: its own norm module, then the
    lm_head (passed in: the drafter holds it once), then the config's post-head steps.

    Not an `nn.Module` on purpose: the drafter keeps it outside its state_dict (nothing of the
    target is exported or trained); it follows the input's device on first use.
    """

    def __init__(self, norm: nn.Module, *, softcap: float | None = None, scale: float | None = None) -> None:
        self.norm = norm.eval().requires_grad_(False)
        self.softcap = softcap
        self.scale = scale

    def __call__(self, last_hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        weight = next(self.norm.parameters(), None)
        if weight is not None and weight.device != last_hidden.device:
            self.norm.to(last_hidden.device)
        with torch.autocast(last_hidden.device.type, enabled=False):
            normed = self.norm(last_hidden.float())
        logits = lm_head(normed.to(last_hidden.dtype)) if last_hidden.dtype != torch.float32 else lm_head(normed)
        return apply_post_head(logits, scale=self.scale, softcap=self.softcap)


def _checkpoint_name(names: list[str], qualified: str) -> str | None:
    """The checkpoint tensor for the model's parameter `qualified` (e.g. `model.norm.weight`):
    the exact name, else the shortest decoder name ending in the same `norm.weight`-like tail
    (`model.language_model.norm.weight` in a multimodal checkpoint)."""
    if qualified in names:
        return qualified
    tail = "." + qualified.split(".", 1)[-1] if qualified.startswith("model.") else "." + qualified
    hits = [n for n in names if ("." + n).endswith(tail) and ".layers." not in n
            and not n.startswith(_NOT_THE_DECODER)]
    return min(hits, key=lambda n: (len(n), n)) if hits else None


def load_target_head(target_dir: str | Path) -> TargetHead:
    """The target's final norm, as transformers builds it for this target, with its weights."""
    from transformers import AutoModelForCausalLM

    target_dir = Path(target_dir)
    config = load_target_config(target_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as e:
        raise TargetUnreadableError(Finding("train.target-modules", file=str(target_dir / "config.json"),
                                            error=str(e))) from e
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module):
        raise TargetUnreadableError(Finding("train.target-no-norm-module", dir=str(target_dir),
                                            model=type(model).__name__))
    prefix = next(name for name, module in model.named_modules() if module is norm)
    locations = tensor_locations(target_dir)
    names = list(locations)
    norm.to_empty(device="cpu")
    state = {}
    for key in norm.state_dict():
        name = _checkpoint_name(names, f"{prefix}.{key}")
        if name is None:
            raise TargetFilesError(Finding("train.target-no-final-norm", dir=str(target_dir), tensor=f"{prefix}.{key}"))
        with safe_open(str(locations[name]), framework="pt") as f:
            state[key] = f.get_tensor(name).float()
    norm.load_state_dict(state)
    return TargetHead(norm.float(), **post_head_steps(config))


# -- the mask token ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskTokenChoice:
    """Which embedding row the drafter uses for masked block positions, and why."""

    token_id: int
    token: str | None
    """Its string in the tokenizer (written to the export), None for a row beyond the tokenizer."""
    reason: str

    def describe(self) -> str:
        token = f" {self.token!r}" if self.token else ""
        return f"mask token: id {self.token_id}{token} ({self.reason})"


def _is_mask_like(token: str) -> bool:
    core = token.strip("<>[]|_ ").lower()
    return core in ("mask", "mask_token")


def choose_mask_token(target_dir: str | Path, vocab_size: int) -> MaskTokenChoice:
    """The tokenizer's mask token when it has one (its `mask_token`, else a special token spelled
    like `<|MASK|>`, `<mask>` or `[MASK]`); else the first embedding row the tokenizer never
    produces (the padding rows of e.g. Qwen3's 151,936-row embedding); else a reserved special
    token (Llama 3's `<|reserved_special_token_N|>`); else the last row, `vocab_size - 1`."""
    tokenizer = _load_tokenizer(target_dir)
    if tokenizer is None:
        return MaskTokenChoice(vocab_size - 1, None, "no tokenizer in the target directory: the last embedding row")
    mask = getattr(tokenizer, "mask_token", None)
    if isinstance(mask, str) and mask:
        token_id = tokenizer.convert_tokens_to_ids(mask)
        if isinstance(token_id, int) and 0 <= token_id < vocab_size:
            return MaskTokenChoice(token_id, mask, "the tokenizer's mask_token")
    special = {str(t): i for t, i in tokenizer.get_added_vocab().items() if 0 <= i < vocab_size}
    for token, token_id in sorted(special.items(), key=lambda kv: kv[1]):
        if _is_mask_like(token):
            return MaskTokenChoice(token_id, token, "a mask token of the tokenizer")
    if len(tokenizer) < vocab_size:
        return MaskTokenChoice(len(tokenizer), None,
                               f"the first embedding row the tokenizer never produces ({len(tokenizer)} tokens)")
    for token, token_id in sorted(special.items(), key=lambda kv: kv[1]):
        if "reserved" in token.lower():
            return MaskTokenChoice(token_id, token, "a reserved special token of the tokenizer")
    last = tokenizer.convert_ids_to_tokens(vocab_size - 1)
    return MaskTokenChoice(vocab_size - 1, last if isinstance(last, str) else None,
                           "the last embedding row (the tokenizer has no mask, unused or reserved token; "
                           "pass --mask-token-id to choose another)")


def _load_tokenizer(target_dir: str | Path) -> Any | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(target_dir) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise TargetUnreadableError(Finding("train.target-tokenizer", dir=str(target_dir), error=str(e))) from e

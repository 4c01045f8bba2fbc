"""The DFlash drafter: fused target context + Qwen3-style layers over one masked block.

Shapes: `K` captured target layers of width `D`; a batch of `B` sequences of `T` tokens;
`Q` block tokens per sequence (all anchors' blocks laid end to end).

Every draft layer attends from the block tokens to `[fused context ; block]`. The fused context
(`hidden_norm(fc(concat of K target states))`) is the same tensor in every layer: each layer
only projects it through its own `k_proj`/`v_proj` (+ `k_norm`, RoPE at the token's position);
the context is never run through the layers. This matches z-lab's reference model, SGLang and
vLLM, so an export behaves the same there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.train.config import COMPILE_MODES  # torch.compile's, beside --compile-mode
from dflash.train.heads import get_head
from dflash.train.model.attention import AttentionMask, inference_mask
from dflash.train.model.drafter_config import DrafterConfig
from dflash.train.model.layers import DrafterLayer, RMSNorm, rms_normalize
from dflash.train.model.rope import (
    RotaryEmbedding,
)
from dflash.train.model.target_head import TargetHead, choose_mask_token, load_target_head
from dflash.train.model.target_weights import (
    TargetMismatchError,
    TargetWeights,
    load_target_config,
    load_target_weights,
)
from torch import nn


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter with the target's frozen embedding and lm_head.

    The frozen tensors are non-persistent buffers: they are not in `state_dict()`, not
    trained and not exported (loaders take them from the target again).
    """

    def __init__(self, config: DrafterConfig, target: TargetWeights, *, target_norm_eps: float | None = None,
                 target_head: TargetHead | None = None) -> None:
        super().__init__()
        c = self.config = config
        rows, width = target.embed_tokens.shape
        if width != c.hidden_size or rows != c.vocab_size or target.lm_head.shape != (rows, width):
            raise TargetMismatchError(Finding(
                "train.target-embedding-shape", embedding=list(target.embed_tokens.shape),
                lm_head=list(target.lm_head.shape), vocab_size=c.vocab_size, hidden_size=c.hidden_size))
        self.fc = nn.Linear(c.num_context_layers * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = get_head(c.drafter_type)  # what the drafter adds to the backbone (train/heads/)
        module = self.head.build(c)
        for name, part in (module if isinstance(module, dict) else {self.head.module_name: module}).items():
            if part is not None:  # e.g. DFlash2's candidate_selector: its name prefixes its tensors
                setattr(self, name, part)
        self.register_buffer("embed_weight", target.embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.detach(), persistent=False)
        norm = target.final_norm
        self.register_buffer("target_norm_weight", None if norm is None else norm.detach(), persistent=False)
        self.target_norm_eps = c.rms_norm_eps if target_norm_eps is None else target_norm_eps
        self.target_head = target_head  # not a submodule: never in state_dict, never trained
        self.rotary = RotaryEmbedding(c)
        self._compiled_forward: Callable[..., torch.Tensor] | None = None  # compile_training()
        self._cuda_graphs = False
        self.compiled_loss = False  # compile_training(): the head's loss compiled too (train/loss/head_loss.py)
        self.reset_parameters()

    @classmethod
    def from_target(cls, target_dir: str | Path, *, with_final_norm: bool = False,
                    announce: Callable[[str], None] | None = None, **overrides: Any) -> DFlashDrafter:
        """A freshly initialized drafter for the checkpoint in `target_dir` (reads only a few tensors).

        Without a `mask_token_id` override the mask token comes from the target's tokenizer; the
        choice is passed to `announce` (e.g. the run log's `info`) and kept in the config (and so
        in checkpoints and exports). `with_final_norm` loads the target's own final norm for
        soft labels.
        """
        target_config = load_target_config(target_dir)
        if overrides.get("mask_token_id") is None:
            choice = choose_mask_token(target_dir, target_config.vocab_size)
            if announce is not None:
                announce(choice.describe())
            overrides = {**overrides, "mask_token_id": choice.token_id, "mask_token": choice.token}
        config = DrafterConfig.from_target_config(target_config, **overrides)
        weights = load_target_weights(
            target_dir, tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
        )
        head = load_target_head(target_dir) if with_final_norm else None
        return cls(config, weights, target_head=head)

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.head.initialize(self, std)  # after the loop above, which also reaches the head's Linears

    @property
    def head_module(self) -> nn.Module | None:
        """The head's module on the backbone's states (`DraftHead.build`), or None."""
        name = self.head.module_name
        return getattr(self, name, None) if name else None

    # -- pieces -----------------------------------------------------------------------------

    def fuse_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, K*D] captured target states -> [B, T, D] fused context."""
        expected = self.config.num_context_layers * self.config.hidden_size
        if hidden.shape[-1] != expected:
            raise TargetMismatchError(Finding(
                "train.hidden-width", width=int(hidden.shape[-1]), expected=expected,
                layers=self.config.num_context_layers, hidden_size=self.config.hidden_size))
        return self.hidden_norm(self.fc(hidden.to(self.fc.weight.dtype)))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight).to(self.fc.weight.dtype)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, like.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen target lm_head over normed drafter states."""
        weight = self.lm_head_weight
        if not torch.is_autocast_enabled(h.device.type):
            weight = weight.to(h.dtype)  # autocast casts by itself; otherwise match dtypes
        return F.linear(h, weight)

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its final pre-norm hidden state (for soft labels).

        Through the target's own final norm module (`target_head`); a drafter built from bare
        tensors (`TargetWeights.final_norm`) applies a Qwen3/Llama RMSNorm with that weight.
        """
        if self.target_head is not None:
            return self.target_head(last_hidden, self.logits)
        if self.target_norm_weight is None:
            raise ValueError(
                "soft labels from last_hidden need the target's final norm: build the drafter "
                "with from_target(..., with_final_norm=True)."
            )
        normed = self.target_norm_weight.to(last_hidden.dtype) * rms_normalize(last_hidden, self.target_norm_eps)
        return self.logits(normed)

    def _layer_context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rope(positions, context)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def run_block(self, block_ids, block_positions, context_kv, masks) -> torch.Tensor:
        """`masks`: one AttentionMask (or None: no mask) per draft layer, or one for all."""
        if masks is None or isinstance(masks, AttentionMask):
            masks = [masks] * len(self.layers)
        x = self.embed(block_ids)
        rope = self.rope(block_positions, x)
        for layer, kv, mask in zip(self.layers, context_kv, masks):
            x = layer(x, kv, rope, mask)
        return self.norm(x)

    def block_masks(self, context_positions: torch.Tensor | None, context_valid: torch.Tensor | None,
                    block_positions: torch.Tensor) -> list[AttentionMask | None]:
        """Per-layer inference masks of one drafted block (`attention.inference_mask`)."""
        built: dict[tuple[int | None, bool], AttentionMask | None] = {}
        kinds = [self.config.layer_attention(i) for i in range(len(self.layers))]
        for window, causal in kinds:
            if (window, causal) not in built:
                built[window, causal] = inference_mask(context_positions, context_valid, block_positions,
                                                       window=window, causal=causal)
        return [built[kind] for kind in kinds]

    # -- training path ----------------------------------------------------------------------

    def compile_training(self, mode: str = "default", *, per_layer: bool = False, dynamic: bool = False) -> None:
        """torch.compile (`mode`: torch.compile's) the whole training forward, one graph forward
        and one backward, or with `per_layer` each draft layer alone (FSDP, recomputed layers).
        `dynamic`: every input size symbolic from the first compile (else torch's default: static
        first, then dynamic for each size seen to vary, one recompile each)."""
        if mode not in COMPILE_MODES:
            raise SettingError(Finding("train.compile-mode", mode=mode, choices=list(COMPILE_MODES)))
        shapes = True if dynamic else None
        self.compiled_loss = True
        if per_layer:
            for layer in self.layers:
                layer.compile(mode=mode, dynamic=shapes)
            return
        self._compiled_forward = torch.compile(self._forward, mode=mode, dynamic=shapes)
        self._cuda_graphs = mode == "reduce-overhead"

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """The uncompiled forward while the block runs (evaluation: a no-grad graph for its
        shapes would cost compiles that a few short passes never pay back)."""
        compiled, self._compiled_forward = self._compiled_forward, None
        loss, self.compiled_loss = self.compiled_loss, False  # the head's loss too (its no-grad graphs)
        try:
            yield
        finally:
            self._compiled_forward, self.compiled_loss = compiled, loss

    def forward(
        self,
        hidden: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        mask: AttentionMask | list[AttentionMask],
    ) -> torch.Tensor:
        """Normed drafter states [B, Q, D] of all blocks of a batch in one pass.

        `hidden` [B, T, K*D] is the context (token t at position t); `block_ids` and
        `block_positions` [B, Q] are the block tokens and their absolute positions; `mask`
        comes from `attention.build_layer_masks` (one per layer) or `build_attention_mask`.
        """
        compiled = self._compiled_forward
        if compiled is None:
            return self._forward(hidden, block_ids, block_positions, mask)
        if self.rotary.inv_freq.device != hidden.device:  # moved here, so the graph never holds a CPU tensor
            self.rotary.inv_freq = self.rotary.inv_freq.to(hidden.device)
        if self._cuda_graphs:  # each call starts a step: the previous one's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(hidden, block_ids, block_positions, mask)

    def _forward(self, hidden: torch.Tensor, block_ids: torch.Tensor, block_positions: torch.Tensor,
                 mask: AttentionMask | list[AttentionMask]) -> torch.Tensor:
        context = self.fuse_context(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        return self.run_block(block_ids, block_positions, self._layer_context_kv(context, positions), mask)

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
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from dflash.runtime.logits import post_head_steps
from torch import nn

from .attention import ATTENTION_BACKENDS, AttentionMask, inference_mask
from .dflash2 import (
    DEFAULT_CONV_GROUP_SIZE,
    DEFAULT_CONV_KERNEL_SIZE,
    DEFAULT_SELECTOR_RANK,
    DEFAULT_SELECTOR_TOP_K,
    DRAFTER_TYPES,
    CandidateSelector,
    GroupedDynamicConv,
)
from .layer_types import parse_layer_types
from .layers import DrafterLayer, RMSNorm, rms_normalize
from .rope import (  # noqa: F401 - rope_parameters_from_config is part of this module's interface
    RotaryEmbedding,
    apply_rope,
    drafter_rope_parameters,
    rope_parameters_from_config,
)
from .target_head import TargetHead, choose_mask_token, load_target_head
from .target_weights import (
    TargetWeights,
    default_target_layer_ids,
    load_target_config,
    load_target_weights,
)


@dataclass(kw_only=True)
class DrafterConfig:
    """Dimensions and DFlash settings of a drafter (usually built by `from_target_config`)."""

    hidden_size: int
    """Width of the target's hidden states; the drafter must match it."""
    num_attention_heads: int
    """Query heads per draft layer."""
    num_key_value_heads: int
    """Key/value heads per draft layer (grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    vocab_size: int
    """Rows of the target's embedding and lm_head."""
    num_target_layers: int
    """Decoder layers of the target (written to the export; used by the default layer rule)."""
    num_hidden_layers: int = 5
    """Number of draft decoder layers."""
    target_layer_ids: list[int] | None = None
    """Target layers whose outputs are fused; None picks `default_target_layer_ids`."""
    block_size: int = 16
    """Tokens per drafted block: the anchor plus block_size-1 predictions."""
    mask_token_id: int | None = None
    """Embedding row used for the masked block positions; None means vocab_size - 1
    (`from_target` picks it from the tokenizer instead: `target_head.choose_mask_token`)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    """RoPE settings, transformers 5.x style: {"rope_type", "rope_theta", scaling keys...}."""
    max_position_embeddings: int = 40960
    """Longest position the RoPE settings are meant for (copied from the target)."""
    attention_backend: str = "auto"
    """"sdpa" (dense mask, any device), "flex" (block-sparse, compiled on CUDA) or "auto"."""
    layer_types: list[str] | None = None
    """Per draft layer "full_attention" or "sliding_attention" (None: all full)."""
    sliding_window: int | None = None
    """Keys a sliding layer's query sees: positions q - sliding_window < j <= q (context and block)."""
    causal: bool | None = None
    """Block tokens see only earlier block tokens; None follows the engines' convention: sliding
    layers causal, full layers bidirectional."""
    mask_token: str | None = None
    """The mask token's string in the target tokenizer, when it has one (written to the export)."""
    drafter_type: str = "dflash"
    """"dflash", or "dflash2": the same drafter plus in-block convolutions around every sublayer and
    a candidate selector over the target head's top-K (train/dflash2.py)."""
    conv_kernel_size: int = DEFAULT_CONV_KERNEL_SIZE
    """DFlash2: taps of the in-block convolutions."""
    conv_group_size: int = DEFAULT_CONV_GROUP_SIZE
    """DFlash2: channels sharing one dynamic tap offset (must divide hidden_size)."""
    selector_rank: int = DEFAULT_SELECTOR_RANK
    """DFlash2: rank of the selector's codebooks and hidden projection."""
    selector_top_k: int = DEFAULT_SELECTOR_TOP_K
    """DFlash2: candidates per slot (the target head's top-K)."""
    output_multiplier: float = 1.0
    """The target's factor on its logits (Cohere's logit_scale, 1 / Granite's logits_scaling), applied
    to the selector's candidate scores as the engines do."""
    final_logit_softcapping: float | None = None
    """The target's logit soft cap (Gemma 2/3), applied to the selector's candidate scores."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "num_target_layers", "num_hidden_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); fix one of them."
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + predictions), got {self.block_size}.")
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's layers 0..{self.num_target_layers - 1}."
            )
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's embedding "
                f"(vocab_size {self.vocab_size}); pick an unused or reserved token id below it."
            )
        if "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters must contain rope_theta (the target's RoPE base).")
        self.rope_parameters = drafter_rope_parameters(self.rope_parameters)
        self.layer_types = parse_layer_types(self.layer_types, self.num_hidden_layers)
        if "sliding_attention" in self.layer_types:
            if self.sliding_window is None or int(self.sliding_window) < 1:
                raise ValueError(
                    f"sliding draft layers need sliding_window >= 1 (got {self.sliding_window}); "
                    "pass --draft-sliding-window N."
                )
            self.sliding_window = int(self.sliding_window)
        else:
            self.sliding_window = None
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"drafter_type must be one of {DRAFTER_TYPES}, got {self.drafter_type!r}.")
        if self.drafter_type == "dflash2":
            if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size} and "
                    f"conv_kernel_size ({self.conv_kernel_size}) be at least 1.")
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_rank ({self.selector_rank}) must be >= 1 and selector_top_k "
                                 f"({self.selector_top_k}) in 1..{self.vocab_size}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}."
            )

    def layer_attention(self, index: int) -> tuple[int | None, bool]:
        """(window or None, causal) of draft layer `index`, as the serving engines resolve it."""
        sliding = self.layer_types[index] == "sliding_attention"
        causal = sliding if self.causal is None else bool(self.causal)
        return (self.sliding_window if sliding else None), causal

    @property
    def num_context_layers(self) -> int:
        """K: how many target layers are fused (the cache's hidden width is K * hidden_size)."""
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(cls, target_config: Any, **overrides: Any) -> DrafterConfig:
        """Take every dimension from a transformers config of the target; `overrides` win."""
        c = target_config
        num_heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        values: dict[str, Any] = dict(
            hidden_size=c.hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            num_target_layers=c.num_hidden_layers,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_parameters=rope_parameters_from_config(c),
            max_position_embeddings=getattr(c, "max_position_embeddings", 40960),
        )
        head = post_head_steps(c)
        values.update(output_multiplier=head["scale"] or 1.0, final_logit_softcapping=head["softcap"])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {sorted(unknown)}.")
        values.update(overrides)
        return cls(**values)

    def to_hf_config(self) -> Any:
        """A transformers Qwen3Config with the drafter's dimensions (RoPE tables are built from it).

        transformers 5.x reads `rope_parameters`; 4.57 reads `rope_theta` and `rope_scaling`.
        """
        import inspect

        from transformers import Qwen3Config

        rope = dict(self.rope_parameters)
        if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
            rope_kwargs: dict[str, Any] = {"rope_parameters": rope}
        else:
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            rope_kwargs = {"rope_theta": rope["rope_theta"],
                           "rope_scaling": scaling if scaling["rope_type"] != "default" else None}
        return Qwen3Config(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            **rope_kwargs,
        )


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's


@dataclass
class ContextCache:
    """Per-layer keys/values of the fused context seen so far (the inference path)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Forget context positions >= `length` (after the target rejects drafted tokens)."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


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
            raise ValueError(
                f"target embedding {tuple(target.embed_tokens.shape)} / lm_head {tuple(target.lm_head.shape)} "
                f"do not match vocab_size {c.vocab_size} x hidden_size {c.hidden_size}; the drafter's "
                "dimensions must come from the same target."
            )
        self.fc = nn.Linear(c.num_context_layers * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = (CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k)
                                   if c.drafter_type == "dflash2" else None)
        self.register_buffer("embed_weight", target.embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head_weight", target.lm_head.detach(), persistent=False)
        norm = target.final_norm
        self.register_buffer("target_norm_weight", None if norm is None else norm.detach(), persistent=False)
        self.target_norm_eps = c.rms_norm_eps if target_norm_eps is None else target_norm_eps
        self.target_head = target_head  # not a submodule: never in state_dict, never trained
        self.rotary = RotaryEmbedding(c)
        self._compiled_forward: Callable[..., torch.Tensor] | None = None  # compile_training()
        self._cuda_graphs = False
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
        for module in self.modules():  # after the loop above, which also reaches their Linears
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_parameters(std)

    # -- pieces -----------------------------------------------------------------------------

    def fuse_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, K*D] captured target states -> [B, T, D] fused context."""
        expected = self.config.num_context_layers * self.config.hidden_size
        if hidden.shape[-1] != expected:
            raise ValueError(
                f"hidden states have width {hidden.shape[-1]}, expected {expected} "
                f"({self.config.num_context_layers} target layers x {self.config.hidden_size}); "
                "the cache was extracted with other target layers or another model."
            )
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
            raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}.")
        shapes = True if dynamic else None
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
        try:
            yield
        finally:
            self._compiled_forward = compiled

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

    # -- inference path ---------------------------------------------------------------------

    def new_context_cache(self) -> ContextCache:
        return ContextCache(keys=[], values=[])

    @torch.no_grad()
    def append_context(self, cache: ContextCache, hidden: torch.Tensor) -> None:
        """Add the captured target states [B, n, K*D] of the next n tokens to `cache`."""
        start = cache.length
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        new = self._layer_context_kv(self.fuse_context(hidden), positions)
        if not cache.keys:
            cache.keys, cache.values = [k for k, _ in new], [v for _, v in new]
            return
        cache.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(cache.keys, new)]
        cache.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(cache.values, new)]

    @torch.no_grad()
    def draft_block(self, cache: ContextCache, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, block_size-1, V] for the block after the anchors [B].

        The anchor sits at position `cache.length`: the cache holds exactly the context before
        it, as in training (the anchor's own target state is not yet known to an engine).
        """
        c = self.config
        if cache.length == 0:
            raise ValueError("append_context at least one token before drafting a block.")
        batch = anchor_ids.shape[0]
        block_ids = torch.full((batch, c.block_size), c.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        positions = cache.length + torch.arange(c.block_size, device=anchor_ids.device).expand(batch, -1)
        context_positions = torch.arange(cache.length, device=anchor_ids.device).expand(batch, -1)
        masks = self.block_masks(context_positions, None, positions)
        h = self.run_block(block_ids, positions, list(zip(cache.keys, cache.values)), masks)
        return self.logits(h[:, 1:])

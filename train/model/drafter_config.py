"""The drafter's dimensions and DFlash settings (`DrafterConfig`), apart from the model so that
its layers (train/model/layers.py) and the model (train/model/drafter.py) both read it without importing
each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.runtime.logits import post_head_steps
from dflash.train.config import DrafterSettings
from dflash.train.heads import get_head
from dflash.train.model.attention import ATTENTION_BACKENDS
from dflash.train.model.layer_types import parse_layer_types
from dflash.train.model.rope import drafter_rope_parameters, rope_parameters_from_config
from dflash.train.model.target_weights import default_target_layer_ids


@dataclass(kw_only=True)
class DrafterConfig(DrafterSettings):
    """Dimensions and DFlash settings of a drafter (usually built by `from_target_config`).

    The settings a run chooses (block_size, mask_token_id, attention_backend, drafter_type and
    DFlash2's selector and convolutions) are `DrafterSettings`, declared once with the trainer's
    model section; a None mask_token_id here means vocab_size - 1 (`from_target` picks it from the
    tokenizer instead: `target_head.choose_mask_token`)."""

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
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    """RoPE settings, transformers 5.x style: {"rope_type", "rope_theta", scaling keys...}."""
    max_position_embeddings: int = 40960
    """Longest position the RoPE settings are meant for (copied from the target)."""
    layer_types: list[str] | None = None
    """Per draft layer "full_attention" or "sliding_attention" (None: all full)."""
    sliding_window: int | None = None
    """Keys a sliding layer's query sees: positions q - sliding_window < j <= q (context and block)."""
    causal: bool | None = None
    """Block tokens see only earlier block tokens; None follows the engines' convention: sliding
    layers causal, full layers bidirectional."""
    mask_token: str | None = None
    """The mask token's string in the target tokenizer, when it has one (written to the export)."""
    output_multiplier: float = 1.0
    """The target's factor on its logits (Cohere's logit_scale, 1 / Granite's logits_scaling), applied
    to the selector's candidate scores as the engines do."""
    final_logit_softcapping: float | None = None
    """The target's logit soft cap (Gemma 2/3), applied to the selector's candidate scores."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the heads' settings' ranges (DrafterSettings)
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "num_target_layers", "num_hidden_layers"):
            if int(getattr(self, name)) < 1:
                raise SettingError(Finding("train.drafter-size", field=name, value=getattr(self, name)))
        if self.num_attention_heads % self.num_key_value_heads:
            raise SettingError(Finding("train.drafter-kv-heads", heads=self.num_attention_heads,
                                       kv_heads=self.num_key_value_heads))
        if self.block_size < 2:
            raise SettingError(Finding("train.drafter-block-size", block_size=self.block_size))
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise SettingError(Finding("train.drafter-no-target-layers"))
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise SettingError(Finding("train.drafter-target-layers", outside=bad,
                                       num_target_layers=self.num_target_layers))
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise SettingError(Finding("train.drafter-mask-token", mask_token_id=self.mask_token_id,
                                       vocab_size=self.vocab_size))
        if "rope_theta" not in self.rope_parameters:
            raise SettingError(Finding("train.drafter-rope-theta"))
        self.rope_parameters = drafter_rope_parameters(self.rope_parameters)
        self.layer_types = parse_layer_types(self.layer_types, self.num_hidden_layers)
        if "sliding_attention" in self.layer_types:
            if self.sliding_window is None or int(self.sliding_window) < 1:
                raise SettingError(Finding("train.drafter-sliding-window", sliding_window=self.sliding_window))
            self.sliding_window = int(self.sliding_window)
        else:
            self.sliding_window = None
        get_head(self.drafter_type).check(self)  # an unknown name: a HeadSettingError (a ValueError) naming the heads
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SettingError(Finding("train.attention-backend", backend=self.attention_backend,
                                       choices=list(ATTENTION_BACKENDS)))

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
            raise SettingError(Finding("train.drafter-fields-unknown", fields=sorted(unknown)))
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

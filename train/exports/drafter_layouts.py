"""The drafter checkpoint layouts `--init-drafter` reads, one reader per trainer, by name.

A layout is how a trainer writes a DFlash-family drafter: its config.json's keys and its tensor
names. Each `DrafterLayout` says whether a config.json is its own (`detect`) and reads its
directory into this trainer's terms (`read`: a `DrafterConfig` and the tensors under this
trainer's names, without the target's own tensors). `read_drafter` tries them in order, the
broadest (the DFlash export layout) last; another trainer's layout is one `register_layout`.

The built-in layouts, as their writers write them:

- `export`: this trainer's exports and the layout z-lab's releases, vLLM and SGLang load (a Qwen3
  config.json with `dflash_config`, `block_size` and the head's keys; tensors `fc`, `hidden_norm`,
  `layers.N.*`, `norm` and the head's), also written by SpecForge's and ModelOpt's DFlash exports.
  Tensor names may carry a wrapper's prefix (`model.`, as vLLM names them; `dflash_module.`,
  ModelOpt's module; `draft_model.`, SpecForge's trainer) and the weights may be sharded
  (`model.safetensors.index.json`).
- `speculators` (speculators 0.9): config.json with `speculators_model_type` (dflash, dflash2,
  dspark), the draft layers' Qwen3 config as `transformer_layer_config` (only the values that
  differ from Qwen3Config's defaults), `aux_hidden_state_layer_ids` counted with the embedding
  output as layer 0 (a DFlash `target_layer_ids` entry i is its i + 1), `mask_token_id`,
  `block_size`, `draft_vocab_size`, `sample_from_anchor` and the head's keys at the top level;
  the tensors named as in the DFlash layout.
- `specforge`: SpecForge's DFlash-family exports whose `dflash_config` names a `projector_type`:
  DSpark (`DSparkDraftModel`, its Markov and confidence keys in `dflash_config`; early ones put
  the heads under `logit_head.`). A plain DFlash export of SpecForge is the DFlash layout.
- `modelopt`: ModelOpt's DSpark and Domino exports (`DFlashDraftModel` with a `projector_type`;
  the DSpark tensors `markov_w1`, `markov_w2`, `confidence_proj` without a module prefix). A
  plain DFlash export of ModelOpt is the DFlash layout.

What none of these drafters can start: one whose anchor slot drafts too (`sample_from_anchor`
true, `shift_label` true: its slot k predicts what this trainer's slot k+1 does), one with a
reduced draft vocabulary (its own lm_head and token map), a Domino head. Each is refused naming
its key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from dflash.runtime.findings import Finding
from dflash.train.exports.export import (
    CONFIG_NAME,
    NoDrafterError,
    UnreadableDrafterError,
    config_from_export,
    read_export_config,
    read_export_weights,
)
from dflash.train.heads import get_head, head_for_architecture, head_names
from dflash.train.model.drafter_config import DrafterConfig

WRAPPER_PREFIXES = ("model.", "dflash_module.", "draft_model.")
"""Prefixes a checkpoint may put before the drafter's tensor names (vLLM's `model.`, ModelOpt's
module, SpecForge's trainer wrapper); none of this trainer's names starts with one."""
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
"""The target's tensors a checkpoint may carry a copy of: the drafter reads them from the target."""


@dataclass(frozen=True)
class DrafterLayout:
    """One trainer's way of writing a drafter."""

    name: str
    title: str
    """How the startup line names it ("speculators' layout")."""
    detect: Callable[[dict[str, Any]], bool]
    """config.json (a dict) -> whether it is written in this layout."""
    read: Callable[[Path, dict[str, Any], Any], tuple[DrafterConfig, dict[str, torch.Tensor]]]
    """(directory, its config.json, the target's config) -> the drafter's DrafterConfig and its
    tensors under this trainer's names (`drafter_tensors` drops the target's); ValueError naming
    the key it cannot read."""


@dataclass
class ReadDrafter:
    layout: DrafterLayout
    config: DrafterConfig
    state: dict[str, torch.Tensor]
    dropped: list[str] = field(default_factory=list)
    """The target's tensors the checkpoint carried a copy of (not loaded)."""


_LAYOUTS: list[DrafterLayout] = []


def register_layout(layout: DrafterLayout) -> DrafterLayout:
    """Add `layout`, tried before the DFlash layout (the broadest) and after the others; a name
    taken already is refused. Returns `layout`."""
    if any(known.name == layout.name for known in _LAYOUTS):
        raise ValueError(f"a drafter layout named {layout.name!r} is registered already.")
    at = next((i for i, known in enumerate(_LAYOUTS) if known.name == "export"), len(_LAYOUTS))
    _LAYOUTS.insert(at, layout)
    return layout


def unregister_layout(name: str) -> None:
    """Forget a layout added with `register_layout` (the built-ins stay)."""
    if name not in _BUILTIN:
        _LAYOUTS[:] = [known for known in _LAYOUTS if known.name != name]


def layout_names() -> tuple[str, ...]:
    """The layouts in the order `read_drafter` tries them."""
    return tuple(known.name for known in _LAYOUTS)


def detect_layout(config: dict[str, Any]) -> DrafterLayout | None:
    """The first layout that takes `config` (a config.json), or None."""
    return next((known for known in _LAYOUTS if known.detect(config)), None)


def read_drafter(drafter_dir: str | Path, target_config: Any) -> ReadDrafter:
    """The drafter at `drafter_dir` in this trainer's terms, whichever registered layout wrote it.
    NoDrafterError (a FileNotFoundError) where it is no drafter directory, UnreadableDrafterError
    (a ValueError) naming what cannot be read."""
    drafter_dir = Path(drafter_dir)
    config_path = drafter_dir / CONFIG_NAME
    if not config_path.is_file():
        raise NoDrafterError(Finding("train.drafter-no-config", dir=str(drafter_dir)))
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise UnreadableDrafterError(Finding("train.drafter-config-not-json", file=str(config_path),
                                             error=str(e))) from e
    if not isinstance(config, dict) or (layout := detect_layout(config)) is None:
        raise UnreadableDrafterError(Finding(
            "train.drafter-layout-unknown", file=str(config_path), layouts=list(layout_names()),
            architectures=config.get("architectures") if isinstance(config, dict) else None))
    drafter_config, state = layout.read(drafter_dir, config, target_config)
    state, dropped = drafter_tensors(state)
    return ReadDrafter(layout, drafter_config, state, dropped)


# -- the shared steps ---------------------------------------------------------------------------


def drafter_tensors(tensors: dict[str, torch.Tensor], renames: dict[str, str] | None = None
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the drafter's tensors under this trainer's names, the target's copies dropped): wrapper
    prefixes stripped, `renames` (old prefix -> new prefix) applied, RoPE buffers dropped. A draft
    vocabulary's token map (d2t / t2d) is refused: such a drafter has its own smaller lm_head."""
    out: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for name, tensor in tensors.items():
        ours = next((name[len(p):] for p in WRAPPER_PREFIXES if name.startswith(p)), name)
        for old, new in (renames or {}).items():
            if ours.startswith(old):
                ours = new + ours[len(old):]
                break
        if ours in ("d2t", "t2d"):
            raise UnreadableDrafterError(Finding("train.drafter-draft-vocab-tensor", tensor=name))
        if ours in TARGET_TENSORS:
            dropped.append(name)
        elif "rotary_emb." not in ours:
            out[ours] = tensor
    return out, sorted(dropped)


def refuse_anchor_drafting(config: dict[str, Any], where: str) -> None:
    """A drafter whose anchor slot drafts (speculators' `sample_from_anchor`, SpecForge's and
    ModelOpt's `shift_label`) predicts at slot k what this trainer's predicts at slot k + 1."""
    for key in ("sample_from_anchor", "shift_label"):
        if config.get(key) is True:
            raise UnreadableDrafterError(Finding("train.drafter-anchor-drafts", key=f"{where}{key}"))


# -- export: this trainer's exports, z-lab's releases, vLLM, SGLang ----------------------------------


def _read_export(drafter_dir: Path, config: dict[str, Any], target_config: Any
                 ) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    hf = read_export_config(drafter_dir)
    refuse_anchor_drafting(hf.get("dflash_config") or {}, "dflash_config.")
    refuse_anchor_drafting(hf, "")
    return config_from_export(hf, target_config), read_export_weights(drafter_dir)


def _is_export(config: dict[str, Any]) -> bool:
    from dflash.train.heads import architectures

    return isinstance(config.get("dflash_config"), dict) or bool(
        set(architectures()) & set(config.get("architectures") or []))


# -- speculators ----------------------------------------------------------------------------------

_SPECULATORS_OWN = frozenset({
    "speculators_model_type", "speculators_version", "speculators_config", "architectures", "auto_map",
    "transformer_layer_config", "draft_vocab_size", "target_hidden_size", "aux_hidden_state_layer_ids",
    "mask_token_id", "block_size", "sliding_window_non_causal", "sample_from_anchor", "transformers_version",
    "torch_dtype", "dtype"})
"""speculators' keys of every drafter: the rest of its config.json's top level is the head's
(conv_*, selector_* of DFlash2; markov_*, *confidence* of DSpark), read as the head reads an
export's dflash_config."""
_QWEN3_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "vocab_size", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
               "max_position_embeddings", "layer_types", "sliding_window")


def _full_layer_config(layer_config: dict[str, Any]) -> dict[str, Any]:
    """`transformer_layer_config` with the defaults it leaves out (speculators writes its diff
    against the config class of its model_type, Qwen3Config unless named)."""
    from transformers import AutoConfig

    given = {k: v for k, v in layer_config.items() if k not in ("model_type", "transformers_version")}
    try:
        full = AutoConfig.for_model(layer_config.get("model_type") or "qwen3", **given).to_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise UnreadableDrafterError(Finding("train.drafter-layer-config", error=str(e))) from e
    return {**full, **given}


def _read_speculators(drafter_dir: Path, config: dict[str, Any], target_config: Any
                      ) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    kind = config.get("speculators_model_type")
    try:  # speculators' model types dflash, dflash2, dspark are this trainer's head names
        head = get_head(str(kind))
    except ValueError as e:
        raise UnreadableDrafterError(Finding("train.drafter-head-unknown", key="speculators_model_type", value=kind,
                                             heads=list(head_names()))) from e
    layers = _full_layer_config(config.get("transformer_layer_config") or {})
    vocab = layers["vocab_size"]
    draft_vocab = config.get("draft_vocab_size", vocab)
    if draft_vocab != vocab:
        raise UnreadableDrafterError(Finding("train.drafter-draft-vocab", draft_vocab=draft_vocab, vocab=vocab))
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layers["hidden_size"]:
        raise UnreadableDrafterError(Finding("train.drafter-target-hidden", target_hidden=target_hidden,
                                             hidden=layers["hidden_size"]))
    refuse_anchor_drafting(config, "")
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise UnreadableDrafterError(Finding("train.drafter-no-aux-layers"))
    if min(aux) < 1:
        raise UnreadableDrafterError(Finding("train.drafter-aux-embedding", aux=list(aux)))
    head_keys = {k: v for k, v in config.items() if k not in _SPECULATORS_OWN and k not in _QWEN3_KEYS}
    dflash: dict[str, Any] = {**head_keys, "target_layer_ids": [i - 1 for i in aux],
                              "mask_token_id": config.get("mask_token_id"), "block_size": config.get("block_size", 8)}
    if "sample_from_anchor" in config:
        dflash["sample_from_anchor"] = config["sample_from_anchor"]
    if "sliding_attention" in (layers.get("layer_types") or []) and config.get("sliding_window_non_causal"):
        dflash["causal"] = False
    hf = {**{k: layers[k] for k in _QWEN3_KEYS if k in layers}, "architectures": [head.architecture],
          "block_size": dflash["block_size"], "num_target_layers": target_config.num_hidden_layers,
          "dflash_config": dflash}
    return config_from_export(hf, target_config), read_export_weights(drafter_dir)


# -- SpecForge and ModelOpt ---------------------------------------------------------------------------


def _method_head(config: dict[str, Any], dflash: dict[str, Any]) -> Any:
    """The head of a SpecForge or ModelOpt export: the one its architectures name, else the one
    its projector_type names (dspark); a Domino drafter (a GRU correction head) has none here."""
    head = head_for_architecture(config.get("architectures"))
    if head is not None:
        return head
    projector = str(dflash.get("projector_type", "dflash"))
    try:
        return get_head(projector)
    except ValueError as e:
        raise UnreadableDrafterError(Finding("train.drafter-head-unknown", key="dflash_config.projector_type",
                                             value=projector, heads=list(head_names()))) from e


def _is_specforge(config: dict[str, Any]) -> bool:
    dflash = config.get("dflash_config")
    return isinstance(dflash, dict) and "projector_type" in dflash and not _is_modelopt(config)


def _read_specforge(drafter_dir: Path, config: dict[str, Any], target_config: Any
                    ) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    dflash = dict(config.get("dflash_config") or {})
    mode = str(dflash.get("attention_mode", "gqa")).lower()
    if mode not in ("gqa", "mha"):
        raise UnreadableDrafterError(Finding("train.drafter-attention-mode", mode=mode))
    refuse_anchor_drafting(dflash, "dflash_config.")
    head = _method_head(config, dflash)
    dflash.update(config.get("dspark_config") or {})
    if "confidence_head_alpha" in dflash:  # SpecForge builds a confidence head where its loss weighs one
        dflash.setdefault("enable_confidence_head", float(dflash["confidence_head_alpha"] or 0.0) > 0)
    dflash["sample_from_anchor"] = bool(dflash.get("shift_label", False))
    hf = {**config, "architectures": [head.architecture], "dflash_config": dflash}
    state, _ = drafter_tensors(read_export_weights(drafter_dir), {"logit_head.": ""})  # early checkpoints' wrapper
    return config_from_export(hf, target_config), state


def _is_modelopt(config: dict[str, Any]) -> bool:
    dflash = config.get("dflash_config")
    return isinstance(dflash, dict) and "projector_type" in dflash and (
        "use_confidence_head" in dflash or "emb_dim" in config)


MODELOPT_NAMES = {"markov_w1.": "markov_head.markov_w1.", "markov_w2.": "markov_head.markov_w2.",
                  "confidence_proj.": "confidence_head.proj."}
"""ModelOpt's DSpark tensor prefixes -> this trainer's."""


def _read_modelopt(drafter_dir: Path, config: dict[str, Any], target_config: Any
                   ) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    dflash = dict(config.get("dflash_config") or {})
    # its DSpark and Domino always draft from the anchor (shift_label true)
    refuse_anchor_drafting({"shift_label": dflash.get("shift_label", True)}, "dflash_config.")
    head = _method_head({}, dflash)
    confidence = bool(dflash.get("use_confidence_head", False))  # its confidence reads the state and the Markov embedding
    dflash.update(enable_confidence_head=confidence, confidence_head_with_markov=confidence, sample_from_anchor=False)
    hf = {**config, "architectures": [head.architecture], "dflash_config": dflash}
    state, _ = drafter_tensors(read_export_weights(drafter_dir), MODELOPT_NAMES)
    return config_from_export(hf, target_config), state


_BUILTIN = ("speculators", "modelopt", "specforge", "export")
for _layout in (
    DrafterLayout("speculators", "speculators' layout", lambda c: "speculators_model_type" in c, _read_speculators),
    DrafterLayout("modelopt", "ModelOpt's layout", _is_modelopt, _read_modelopt),
    DrafterLayout("specforge", "SpecForge's layout", _is_specforge, _read_specforge),
    DrafterLayout("export", "the DFlash export layout", _is_export, _read_export),
):
    _LAYOUTS.append(_layout)

"""Hugging Face export of a drafter, in the layout z-lab's DFlashDraftModel, SGLang and vLLM load.

The directory holds `config.json` (a Qwen3 config plus the DFlash keys) and `model.safetensors`
with the drafter's own weights only: the embedding and lm_head are the target's and are not
written. Every engine must read the same model from it (docs/serving.md):

- RoPE is written both ways, `rope_theta`/`rope_scaling` for transformers 4.57 and
  `rope_parameters` for 5.x, with only the keys a full-rotary drafter uses (no partial-rotary or
  M-RoPE key of the target, which vLLM would apply);
- `block_size` at the top level (z-lab) and in `dflash_config` (SGLang);
- `layer_types` and `sliding_window` per draft layer, and the causality stated explicitly
  (`is_causal` and `dflash_config.causal`, read first by vLLM) whenever all layers share it;
  with mixed layers under the engines' convention (sliding causal, full bidirectional) it is
  left to `layer_types`, which every engine resolves that way;
- the mask token as `dflash_config.mask_token_id` and, when the tokenizer has a string for it,
  `dflash_config.mask_token` (SGLang checks it against the tokenizer).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from dflash.runtime.errors import InputError, SettingError
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import staged_dir
from dflash.runtime.locks import inside
from dflash.runtime.safetensors_files import check_safetensors
from dflash.train.exports.model_card import CARD_NAME, card_text, evaluation_record
from dflash.train.heads import architectures, get_head, head_for_architecture
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.drafter_config import DrafterConfig
from dflash.train.model.rope import rope_parameters_from_config
from dflash.train.model.target_head import load_target_head
from dflash.train.model.target_weights import (
    TargetMismatchError,
    load_target_config,
    load_target_weights,
)
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NoDrafterError(InputError, FileNotFoundError):
    """A directory given as a drafter holds none (a FileNotFoundError, as its readers' callers catch)."""


class UnreadableDrafterError(InputError, ValueError):
    """A drafter directory whose config.json or weights cannot be read as a drafter of this trainer
    (a ValueError, as its readers' callers catch)."""


def _uniform_causality(config: DrafterConfig) -> bool | None:
    """The one causality all draft layers share, or None when they differ."""
    values = {config.layer_attention(i)[1] for i in range(config.num_hidden_layers)}
    return values.pop() if len(values) == 1 else None


# config.json's record of the target a drafter was trained against (cache_tools.identity, with
# the weights' hash, and where it lay): dflash-eval compares it with the target it is given.
# A top-level key of its own, which the engines' loaders and transformers' configs carry along
# unread (tests/test_drafter_export.py loads an export that has it).
TRAINING_KEY = "dflash_training"


def drafter_hf_config(config: DrafterConfig, dtype: torch.dtype = torch.bfloat16, *,
                      training_target: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of an export (`training_target`: {"target": identity, "target_path": ...})."""
    rope = dict(config.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    dtype_name = _DTYPE_NAMES[dtype]
    causal = _uniform_causality(config)
    dflash: dict[str, Any] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
    }
    if config.mask_token is not None:
        dflash["mask_token"] = config.mask_token
    if causal is not None:
        dflash["causal"] = causal
    head = get_head(config.drafter_type)
    dflash.update(head.export_keys(config))  # the keys the engines' loaders read for the head (DFlash2's)
    sliding = "sliding_attention" in config.layer_types
    out = {
        "architectures": [head.architecture],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "num_hidden_layers": config.num_hidden_layers,
        "dflash_config": dflash,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": float(rope["rope_theta"]),
        # 4.57 reads rope_scaling (None for plain RoPE); 5.x reads rope_parameters.
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        # Qwen3Config keeps sliding_window only with use_sliding_window; the layers that use it
        # are named by layer_types (one entry per draft layer: Qwen3Config checks the length).
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
        "initializer_range": 0.02,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if causal is not None:
        out["is_causal"] = causal
    out.update({k: dflash[k] for k in head.config_key_names if k in dflash})  # read at the top level too
    if training_target:
        out[TRAINING_KEY] = dict(training_target)
    return out


def trained_target(drafter_dir: str | Path) -> dict[str, Any] | None:
    """What the export at `drafter_dir` records of the target it was trained against (its
    config.json's `dflash_training`: {"target": identity, "target_path": where it lay}); None
    where it records none (written before it was recorded, or by another trainer)."""
    try:
        trained = json.loads((Path(drafter_dir) / CONFIG_NAME).read_text()).get(TRAINING_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return trained if isinstance(trained, dict) and isinstance(trained.get("target"), dict) else None


def training_target_change(drafter_dir: str | Path, current: dict[str, Any]) -> tuple[str, str] | None:
    """Where the export at `drafter_dir` records that it was trained against another target than
    `current` (a target identity; cache_tools.identity, Purpose.DRAFTER: every field both record):
    (where that target lay, as recorded (None: not recorded), and the differing fields as
    [(field, value when trained, value here)]); None where it records the same target, or none to
    compare (`trained_target`)."""
    from dflash.cache_tools.identity import Purpose, target_differences

    trained = trained_target(drafter_dir)
    diffs = target_differences(trained["target"], current, Purpose.DRAFTER) if trained else []
    if not diffs:
        return None
    where = trained.get("target_path")
    return (None if where is None else str(where)), [(key, str(then), str(now)) for key, then, now in diffs]


def training_target_finding(drafter_dir: str | Path, target_config: Any, target_dir: str | Path) -> Finding | None:
    """`train.drafter-other-target` when the export records the target it was trained against
    (config.json's dflash_training) and that is not this one (another config, tokenizer or
    weights), naming both: dflash-eval and `dflash-train estimate` measure the drafter with the
    target they are given."""
    from dflash.cache_tools.identity import comparable, target_identity

    change = training_target_change(drafter_dir, comparable(target_identity(target_config, target_dir)))
    if change is None:
        return None
    trained_at, differences = change
    return Finding("train.drafter-other-target", drafter=str(drafter_dir), trained=trained_at,
                   here=str(Path(target_dir).resolve()), differences=differences)


EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, CARD_NAME})
"""Everything `export_drafter` writes into its directory (its lock file and staging lie beside it);
an export written before the model card has no README.md."""


def is_export_dir(path: str | Path) -> bool:
    """Whether `path` is a directory as `export_drafter` leaves it: a DFlash drafter's config.json
    (its architectures and dflash_config), model.safetensors and the model card written from that
    config.json (or none, as before the card), and nothing else."""
    path = Path(path)
    try:
        entries = {p.name: p for p in path.iterdir()}
        if not {CONFIG_NAME, WEIGHTS_NAME} <= set(entries) <= EXPORT_FILES or any(
                p.is_symlink() or not p.is_file() for p in entries.values()):
            return False
        config = json.loads(entries[CONFIG_NAME].read_text())
        # a README.md is the card an export writes, as it wrote it: an edited one is the user's
        card = entries[CARD_NAME].read_text() if CARD_NAME in entries else None
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and isinstance(config.get("dflash_config"), dict)
            and config.get("architectures") in [[name] for name in architectures()]
            and (card is None or card == card_text(config, TRAINING_KEY)))


OUT_DIR_PURPOSES = ("export", "command", "run-final")


def export_out_dir(out_dir: str | Path, *, purpose: str = "export") -> Path:
    """`out_dir` as an export may be written to it: absolute, so that `.` and `..` are the
    directories they name. An existing directory is replaced whole, so it must be empty or an
    earlier export (`is_export_dir`); anything else is refused with an InputError, and so are
    the current directory and its parents (replacing them would leave the shell in a deleted
    directory) and a path that is not a directory. `purpose` ("export": an export's directory,
    "command": dflash-train export's OUT_DIR, "run-final": a run's RUN_DIR/final) decides how the
    refusal names the path and what it says to do (train/exports/messages.py)."""
    if purpose not in OUT_DIR_PURPOSES:
        raise ValueError(f"export directory purpose {purpose!r} is not one of {OUT_DIR_PURPOSES}")
    given = Path(out_dir)
    out = Path(os.path.abspath(given))
    where = dict(purpose=purpose, path=str(given), absolute=str(out) if str(out) != str(given) else None)
    if not out.name or inside(Path.cwd(), out):
        raise InputError(Finding("train.export-out-holds-cwd", **where, root=not out.name,
                                 instead=str(given / "drafter")))
    if out.exists() and not out.is_dir():
        raise InputError(Finding("train.export-out-is-file", **where))
    if out.is_dir() and any(out.iterdir()) and not is_export_dir(out):
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        raise InputError(Finding("train.export-out-holds-files", **where, files=names[:5], more=len(names[5:])))
    return out


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                   training_target: dict[str, Any] | None = None) -> Path:
    """Write `drafter` as an HF directory at `out_dir`, atomically (`runtime.fsio.staged_dir`).

    Files are staged in a unique sibling temporary folder, fsynced, and the folder is renamed
    into place; an existing export at `out_dir` is swapped out only after the new one is
    complete, so a crash leaves either the old or the new export, never a mix. Only an empty
    directory or an earlier export is replaced: anything else at `out_dir` is refused
    (`export_out_dir`), before the weights are written and again right before the swap.
    """
    if dtype not in _DTYPE_NAMES:
        raise SettingError(Finding("train.export-dtype", dtype=str(dtype), choices=list(_DTYPE_NAMES.values())))
    with staged_dir(export_out_dir(out_dir), check_old=lambda _: export_out_dir(out_dir)) as stage:
        tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
        save_file(tensors, str(stage / WEIGHTS_NAME), metadata={"format": "pt"})
        config = drafter_hf_config(drafter.config, dtype, training_target=training_target)
        (stage / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (stage / CARD_NAME).write_text(card_text(config, TRAINING_KEY))
        # safetensors creates its file private (0600); the export is read like config.json
        os.chmod(stage / WEIGHTS_NAME, stat.S_IMODE((stage / CONFIG_NAME).stat().st_mode))
    return Path(out_dir)


def update_card(drafter_dir: str | Path, report: dict[str, Any]) -> Path:
    """Record a dflash-eval report's figures in an export (config.json's training record, one entry
    per prompt set, block and temperature, replacing an earlier one of the same) and write its
    model card again from it; returns the card's path. Each file is replaced atomically."""
    from dflash.runtime.fsio import atomic_write_bytes

    drafter_dir = Path(drafter_dir)
    config = read_export_config(drafter_dir)
    record = dict(config.get(TRAINING_KEY) or {})
    fresh = evaluation_record(report)
    key = lambda e: (e["prompt_set"], e["block_size"], e["temperature"])  # noqa: E731
    kept = [e for e in record.get("evaluations") or [] if key(e) not in {key(f) for f in fresh}]
    record["evaluations"] = kept + fresh
    config[TRAINING_KEY] = record
    atomic_write_bytes(drafter_dir / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    atomic_write_bytes(drafter_dir / CARD_NAME, card_text(config, TRAINING_KEY).encode())
    return drafter_dir / CARD_NAME


def config_from_export(hf_config: dict[str, Any], target_config: Any | None = None, **overrides: Any) -> DrafterConfig:
    """DrafterConfig from an export's config.json (transformers 4.57- or 5.x-style keys)."""
    dflash = hf_config.get("dflash_config") or {}
    num_target_layers = hf_config.get("num_target_layers")
    if num_target_layers is None and target_config is not None:
        num_target_layers = target_config.num_hidden_layers
    if num_target_layers is None:
        raise UnreadableDrafterError(Finding("train.export-no-num-target-layers"))
    heads = hf_config["num_attention_heads"]
    values: dict[str, Any] = dict(
        hidden_size=hf_config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        intermediate_size=hf_config["intermediate_size"],
        vocab_size=hf_config["vocab_size"],
        num_target_layers=num_target_layers,
        num_hidden_layers=hf_config["num_hidden_layers"],
        target_layer_ids=dflash.get("target_layer_ids"),
        block_size=hf_config.get("block_size") or dflash.get("block_size") or 16,
        mask_token_id=dflash.get("mask_token_id", hf_config.get("mask_token_id")),
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters_from_config(hf_config),
        max_position_embeddings=hf_config.get("max_position_embeddings", 40960),
        layer_types=hf_config.get("layer_types") or None,
        sliding_window=hf_config.get("sliding_window"),
        mask_token=dflash.get("mask_token"),
    )
    # the head its architecture names; an export that names none of them is a DFlash one (z-lab's layout)
    head = head_for_architecture(hf_config.get("architectures")) or get_head(None)
    top = {k: hf_config[k] for k in head.config_key_names if k in hf_config}
    values.update(drafter_type=head.name, **head.settings_from_export({**top, **dflash}))
    values.update(overrides)
    config = DrafterConfig(**values)
    causal = hf_config.get("is_causal", dflash.get("causal"))
    if causal is not None and causal != _uniform_causality(config) and "causal" not in overrides:
        config = DrafterConfig(**{**values, "causal": bool(causal)})  # not the convention: keep it
    return config


INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded safetensors checkpoint (Hugging Face's save_pretrained): its weight_map
names the shard of each tensor."""


def export_weight_files(drafter_dir: str | Path) -> list[Path]:
    """The safetensors files of a drafter directory: model.safetensors; else the shards its
    model.safetensors.index.json names; else its one *.safetensors file; [] where there is none
    of these (a named shard need not exist: `read_export_weights` names a missing one)."""
    drafter_dir = Path(drafter_dir)
    if (drafter_dir / WEIGHTS_NAME).is_file():
        return [drafter_dir / WEIGHTS_NAME]
    if (drafter_dir / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((drafter_dir / INDEX_NAME).read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise UnreadableDrafterError(Finding("train.export-index-unreadable", file=str(drafter_dir / INDEX_NAME),
                                                 error=str(e))) from e
        return [drafter_dir / name for name in sorted(set(weight_map.values()))]
    found = sorted(p for p in drafter_dir.glob("*.safetensors") if p.is_file())
    return found if len(found) == 1 else []


def read_export_config(drafter_dir: str | Path) -> dict[str, Any]:
    """The config.json of a drafter export (ours, or a z-lab / SGLang / vLLM layout DFlash or
    DFlash2 drafter, its weights in one file or sharded), checked to be one;
    FileNotFoundError / ValueError say what is wrong."""
    drafter_dir = Path(drafter_dir)
    config_path = drafter_dir / CONFIG_NAME
    if not config_path.is_file() or not export_weight_files(drafter_dir):
        raise NoDrafterError(Finding("train.export-missing", dir=str(drafter_dir)))
    hf_config = json.loads(config_path.read_text())
    if "dflash_config" not in hf_config and not set(architectures()) & set(hf_config.get("architectures") or []):
        raise UnreadableDrafterError(Finding("train.export-not-dflash", file=str(config_path),
                                             architectures=hf_config.get("architectures")))
    return hf_config


def read_export_weights(drafter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a drafter export's model.safetensors, or of every shard its index names
    (each checked to be a whole file; a tensor in two shards is refused)."""
    files = export_weight_files(drafter_dir)
    if not files:
        raise NoDrafterError(Finding("train.export-no-weights", dir=str(drafter_dir)))
    tensors: dict[str, torch.Tensor] = {}
    for weights_path in files:
        if not weights_path.is_file():
            raise NoDrafterError(Finding("train.export-shard-missing", file=str(weights_path),
                                         index=str(Path(drafter_dir) / INDEX_NAME)))
        check_safetensors(weights_path, purpose="drafter")
        with safe_open(str(weights_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name in tensors:
                    raise UnreadableDrafterError(Finding("train.export-tensor-twice", tensor=name, dir=str(drafter_dir),
                                                         shard=weights_path.name))
                tensors[name] = f.get_tensor(name)
    return tensors


def load_drafter(
    drafter_dir: str | Path,
    target_dir: str | Path,
    *,
    dtype: torch.dtype | None = torch.float32,
    with_final_norm: bool = False,
    **overrides: Any,
) -> DFlashDrafter:
    """Rebuild a drafter from an export plus the target's embedding and lm_head.

    `dtype` is the dtype of the drafter's own weights (None keeps the file's).
    """
    drafter_dir = Path(drafter_dir)
    hf_config = read_export_config(drafter_dir)
    weights_path = drafter_dir / WEIGHTS_NAME
    target_config = load_target_config(target_dir)
    config = config_from_export(hf_config, target_config, **overrides)
    if (config.hidden_size, config.vocab_size) != (target_config.hidden_size, target_config.vocab_size):
        raise TargetMismatchError(Finding(
            "train.drafter-target-size", drafter=str(drafter_dir), target=str(target_dir),
            drafter_sizes=[config.hidden_size, config.vocab_size],
            target_sizes=[target_config.hidden_size, target_config.vocab_size]))
    weights = load_target_weights(
        target_dir, tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
    )
    head = load_target_head(target_dir) if with_final_norm else None
    drafter = DFlashDrafter(config, weights, target_head=head)
    state = read_export_weights(drafter_dir)
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    drafter.to(dtype)
    # Keep the frozen target tensors in their checkpoint dtype (drafter.to cast them too).
    drafter.embed_weight, drafter.lm_head_weight = weights.embed_tokens, weights.lm_head
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnreadableDrafterError(Finding("train.export-weights-mismatch", file=str(weights_path),
                                             missing=sorted(missing), unexpected=sorted(unexpected)))
    return drafter

"""The peers' side of the data and of the drafter: our cache as SpecForge's offline feature files,
and a peer's export held to our loader's DFlash export contract (train/exports/export.py).

Nothing here imports a peer package: the peers read what these functions write, and the
functions read only what the peers wrote (files), so the conversion is testable without them.

  SpecForge's offline DFlash data is a directory of `.ckpt` files, one `torch.save`d dict per
  sample: `input_ids` [S] int64, `loss_mask` [S] int64, `hidden_states` [S, K*D] bf16, the K
  captured layers concatenated in `target_layer_ids` order (the layout of our cache's `hidden`
  rows and of the live concatenation dflash-eval feeds the drafter). Its reader lists the
  directory sorted by name, so the file names carry the cache's sample order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools.reader import CacheReader
from dflash.train.data.loader import sample_tensors
from safetensors import safe_open
from safetensors.torch import save_file


class PeerBenchError(RuntimeError):
    """A step of the peers' benchmark cannot go on (what, where, what to do)."""


def cache_to_ckpt_dir(cache_dir: str | Path, out_dir: str | Path, *, max_samples: int = 0,
                      min_supervised_pairs: int = 1) -> dict[str, Any]:
    """Write every sample of the cache at `cache_dir` as `out_dir/data_NNNNNNNN.ckpt`.

    A sample without two consecutive supervised tokens is skipped (SpecForge refuses such a
    sample at load time, where it stops the run); the count is returned. The directory is
    written under a temporary name and renamed into place, so a crash never leaves a partial
    directory that a later run would train on.
    """
    out_dir = Path(out_dir)
    reader = CacheReader(cache_dir)
    stage = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    total = len(reader) if max_samples <= 0 else min(max_samples, len(reader))
    written = skipped = tokens = 0
    for i in range(total):
        s = sample_tensors(reader.read_sample(i))  # (the reader gives numpy; bf16 as its bits)
        mask = s["loss_mask"].to(torch.int64)
        if int((mask[1:] * mask[:-1]).sum()) < min_supervised_pairs:
            skipped += 1
            continue
        record = {"input_ids": s["input_ids"].to(torch.int64).contiguous(), "loss_mask": mask.contiguous(),
                  "hidden_states": s["hidden"].to(torch.bfloat16).contiguous()}
        torch.save(record, stage / f"data_{written:08d}.ckpt")
        written += 1
        tokens += int(mask.numel())
    reader.close()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    stage.rename(out_dir)
    manifest = reader.manifest
    return {"samples": written, "skipped": skipped, "tokens": tokens,
            "target_layer_ids": manifest.target_layer_ids, "hidden_size": manifest.hidden_size}


# -- exports ----------------------------------------------------------------------------------

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
DRAFTER_PREFIXES = ("dflash_module.", "draft_model.", "model.")
"""Prefixes a peer may leave on the drafter's tensor names (its wrapper's attribute)."""
FROZEN = ("embed_tokens.weight", "lm_head.weight")
"""The target's tensors: our loader reads them from the target, an export must not carry them."""


def _strip(name: str) -> str:
    for prefix in DRAFTER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def export_changes(config: dict[str, Any], names: list[str], *, block_size: int, mask_token_id: int,
                   target_layer_ids: list[int], num_target_layers: int) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """What a peer export needs to meet our export contract: (new config, {old name: new name}
    for the tensors kept, a sentence per change). Tensors mapped to "" are dropped.

    The trained settings are the ground truth for missing keys (the peer was configured with
    them): `block_size` and `num_target_layers` at the top level, `dflash_config.mask_token_id`
    and `target_layer_ids`; a key the export has with another value is an error, never
    overwritten, since it would mean the peer trained something else than it was told.
    """
    config = json.loads(json.dumps(config))
    notes: list[str] = []
    dflash = config.setdefault("dflash_config", {})
    wanted = {("top", "block_size"): block_size, ("top", "num_target_layers"): num_target_layers,
              ("dflash", "mask_token_id"): mask_token_id, ("dflash", "target_layer_ids"): list(target_layer_ids)}
    for (where, key), value in wanted.items():
        home = config if where == "top" else dflash
        if key not in home or home[key] is None:
            if where == "dflash" and key in config and config[key] is not None:  # at the wrong level
                home[key] = config[key]
                notes.append(f"config: {key} copied from the top level into dflash_config")
            else:
                home[key] = value
                notes.append(f"config: {'dflash_config.' if where == 'dflash' else ''}{key} = {value!r} added "
                             "(from the settings the peer was trained with)")
        if home[key] != value:
            raise PeerBenchError(f"the export says {key} = {home[key]!r} but the peer was configured with "
                                 f"{value!r}: it trained another drafter than the benchmark asked for.")
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        notes.append(f"config: architectures {config.get('architectures')} -> ['DFlashDraftModel']")
        config["architectures"] = ["DFlashDraftModel"]
    layers = int(config["num_hidden_layers"])
    if len(config.get("layer_types") or []) != layers:
        if config.get("layer_types"):
            notes.append(f"config: layer_types of {len(config['layer_types'])} entries -> one per draft layer")
        config["layer_types"] = ["full_attention"] * layers
    renames: dict[str, str] = {}
    for name in names:
        new = _strip(name)
        if new in FROZEN or "rotary_emb" in new or new.endswith(("t2d", "d2t")):
            renames[name] = ""
        elif new != name:
            renames[name] = new
    if dropped := sorted(n for n, v in renames.items() if v == ""):
        notes.append(f"weights: dropped {', '.join(dropped)} (the target's, or buffers our loader recomputes)")
    if moved := sorted(n for n, v in renames.items() if v):
        prefixes = sorted({n[: len(n) - len(renames[n])] for n in moved})
        notes.append(f"weights: prefix {', '.join(prefixes)} stripped from {len(moved)} tensors")
    return config, renames, notes


def normalize_export(src: str | Path, dst: str | Path, *, block_size: int, mask_token_id: int,
                     target_layer_ids: list[int], num_target_layers: int) -> list[str]:
    """Copy the export at `src` to `dst` meeting our export contract; the changes, one sentence
    each (empty: the export met it as it was, and `dst` is a plain copy)."""
    src, dst = Path(src), Path(dst)
    config_path, weights = src / CONFIG_NAME, sorted(src.glob("*.safetensors"))
    if not config_path.is_file() or not weights:
        raise PeerBenchError(f"{src} is not an HF export: it needs {CONFIG_NAME} and a .safetensors file "
                             f"(found {sorted(p.name for p in src.iterdir()) if src.is_dir() else 'no directory'}).")
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for path in weights:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or metadata
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    config, renames, notes = export_changes(
        json.loads(config_path.read_text()), list(tensors), block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids, num_target_layers=num_target_layers)
    if len(weights) > 1 or weights[0].name != WEIGHTS_NAME:
        notes.append(f"weights: {', '.join(p.name for p in weights)} -> one {WEIGHTS_NAME}")
    kept = {renames.get(n, n): t.contiguous() for n, t in tensors.items() if renames.get(n, n)}
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    save_file(kept, str(dst / WEIGHTS_NAME), metadata={"format": "pt", **metadata})
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return notes

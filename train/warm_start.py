"""--init-drafter: a run starts from an exported drafter's weights instead of a random init."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools.identity import comparable, target_identity
from dflash.runtime.errors import InputError

from .export import (
    config_from_export,
    read_export_config,
    read_export_weights,
    trained_target,
    training_target_change,
)
from .heads import get_head
from .model import DFlashDrafter
from .target_weights import load_target_config

_WARM_START_FIELDS = {"num_hidden_layers": "--num-draft-layers", "block_size": "--block-size",
                      "target_layer_ids": "the cache's target layers", "drafter_type": "--drafter-type"}
"""What an --init-drafter export must share with the run's drafter beyond its tensors' shapes."""


def warm_start(drafter: DFlashDrafter, init_dir: str, target_model: str,
               announce: Callable[[str], None] | None = None, *, resume_from: Path | None = None) -> None:
    """Load an exported drafter's weights into the freshly built `drafter` (--init-drafter): its
    shape and what it reads (target layers, block size, drafter type) must be this run's, except
    that a head may start from a drafter of a head it names (`DraftHead.warm_starts_from`: DFlash2
    from DFlash) of its shape: the backbone's tensors come from it, the head's own keep their fresh
    start (DFlash2's convolutions the identity, its selector's edges 0), so the run starts from
    exactly that drafter's predictions. An export that records another target than
    this run's (its `dflash_training`) still loads, as a start from a related run, with a note
    naming both targets. A run that resumes (`resume_from`, its latest checkpoint) takes the
    checkpoint's weights: the export is not loaded, and the startup line says so."""
    if resume_from is not None:
        if announce is not None:
            announce(f"warm start: none, the run resumes from {resume_from}, whose weights win: --init-drafter "
                     f"{init_dir} is ignored on resume (a new --output-dir starts from it)")
        return
    fix = ("pass a drafter exported for this target with this run's shape (dflash-train export "
           "CHECKPOINT OUT_DIR makes one of a checkpoint), set the flags above to the export's, or drop --init-drafter")
    try:
        theirs = config_from_export(read_export_config(init_dir), load_target_config(target_model))
        state = read_export_weights(init_dir)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"--init-drafter {init_dir}: {e} To start from a checkpoint, export it first: "
                         "dflash-train export CHECKPOINT OUT_DIR.") from e
    head = drafter.head  # a head may start from another's export: its own tensors keep their fresh start
    upgrade = theirs.drafter_type != drafter.config.drafter_type and theirs.drafter_type in head.warm_starts_from
    differ = [f"{flag} {_listed(getattr(drafter.config, f))} here, {_listed(getattr(theirs, f))} there"
              for f, flag in _WARM_START_FIELDS.items()
              if getattr(theirs, f) is not None and _listed(getattr(theirs, f)) != _listed(getattr(drafter.config, f))
              and not (upgrade and f == "drafter_type")]
    own = drafter.state_dict()
    wanted = {k for k in own if k not in state} & {k for k, _ in drafter.named_parameters() if _.requires_grad}
    fresh = {k for k in wanted if upgrade and head.owns_tensor(k)}  # the head's own parts, at their start
    wanted -= fresh
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} there, {tuple(own[k].shape)} here" for k in sorted(set(state) & set(own))
              if state[k].shape != own[k].shape]
    if differ or wanted or unexpected or shapes:
        found = "; ".join(differ + shapes[:4] + ([f"missing {sorted(wanted)[:4]}"] if wanted else [])
                          + ([f"not in this drafter {unexpected[:4]}"] if unexpected else []))
        raise InputError(f"--init-drafter {init_dir} does not fit this run's drafter: {found}. Fix: {fix}.")
    with torch.no_grad():
        drafter.load_state_dict(state, strict=False)
    if announce is not None:
        announce(f"warm start: the drafter's {len(state)} weight tensors from {init_dir}" + (
            f", a {get_head(theirs.drafter_type).title} drafter: {head.title}'s {len(fresh)} tensors of its own start "
            f"as they do in a fresh run ({head.warm_start_note()}), so training starts from that drafter's "
            "predictions" if upgrade else "") + (
            "" if trained_target(init_dir) else " (its config.json records no target it was trained against, so "
            "whether that is this run's target is not checked)"))
        if note := other_target_note(init_dir, target_model):
            announce(f"Note: {note}")


def other_target_note(init_dir: str, target_model: str) -> str | None:
    """A sentence when the --init-drafter export records that it was trained against another
    target than this run's (its weights fit, so it loads: a warm start from a related run)."""
    change = training_target_change(init_dir, comparable(target_identity(load_target_config(target_model),
                                                                         target_model)))
    if change is None:
        return None
    trained_at, shown = change
    return (f"--init-drafter {init_dir} was trained against another target ({trained_at}) than this run's "
            f"({Path(target_model).resolve()}): {shown}; its weights fit this drafter and are loaded, so the run "
            "starts from that target's drafter (pass an export of a run on this target if that is not what you meant).")


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value



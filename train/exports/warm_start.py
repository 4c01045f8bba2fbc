"""--init-drafter: a run starts from an exported drafter's weights instead of a random init."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools.identity import comparable, target_identity
from dflash.runtime.errors import InputError
from dflash.train.exports.drafter_layouts import read_drafter
from dflash.train.exports.export import trained_target, training_target_change
from dflash.train.heads import get_head
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.target_weights import load_target_config

_WARM_START_FIELDS = {"num_hidden_layers": "--num-draft-layers", "target_layer_ids": "the cache's target layers",
                      "mask_token_id": "--mask-token-id", "drafter_type": "--drafter-type"}
"""What an --init-drafter drafter must share with the run's drafter beyond its tensors' shapes
(the block size need not: the backbone's weights do not depend on it)."""
_TARGET_FIELDS = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_target_layers": "num_hidden_layers"}
"""The drafter's fields that are the target's (drafter field -> the target config's)."""


def warm_start(drafter: DFlashDrafter, init_dir: str, target_model: str,
               announce: Callable[[str], None] | None = None, *, resume_from: Path | None = None) -> None:
    """Load a drafter's weights into the freshly built `drafter` (--init-drafter), read in any
    layout `drafter_layouts` knows (this trainer's exports, z-lab / vLLM / SGLang, speculators,
    SpecForge, ModelOpt). It must be a drafter of this run's target (hidden size, vocabulary,
    number of layers) reading what this run reads (target layers, mask token) with this run's
    draft layers; its block size may differ (its head's tensors of the block's shape then start
    fresh), and a head may start from a drafter of a head it names (`DraftHead.warm_starts_from`:
    DFlash2 from DFlash): the backbone's tensors come from it, the head's own keep their fresh
    start (DFlash2's convolutions the identity, its selector's edges 0), so the run starts from
    exactly that drafter's predictions. An export that records another target than this run's
    (its `dflash_training`) still loads, as a start from a related run, with a note naming both
    targets. A run that resumes (`resume_from`, its latest checkpoint) takes the checkpoint's
    weights: the drafter is not loaded, and the startup line says so."""
    if resume_from is not None:
        if announce is not None:
            announce(f"warm start: none, the run resumes from {resume_from}, whose weights win: --init-drafter "
                     f"{init_dir} is ignored on resume (a new --output-dir starts from it)")
        return
    fix = ("pass a drafter of this target with this run's shape (dflash-train export CHECKPOINT OUT_DIR makes one "
           "of a checkpoint), set the flags above to the drafter's, or drop --init-drafter")
    target_config = load_target_config(target_model)
    try:
        read = read_drafter(init_dir, target_config)
    except FileNotFoundError as e:
        raise InputError(f"--init-drafter {init_dir}: {e} To start from a checkpoint, export it first: "
                         "dflash-train export CHECKPOINT OUT_DIR.") from e
    except ValueError as e:
        raise InputError(f"--init-drafter {init_dir} cannot start this run: {e} Pass another drafter, or drop "
                         "--init-drafter.") from e
    theirs, state = read.config, read.state
    head = drafter.head  # a head may start from another's drafter: its own tensors keep their fresh start
    upgrade = theirs.drafter_type != drafter.config.drafter_type and theirs.drafter_type in head.warm_starts_from
    target = [f"{f} {getattr(theirs, f)} there, {getattr(target_config, t)} in the target {target_model}"
              for f, t in _TARGET_FIELDS.items() if getattr(theirs, f) != getattr(target_config, t)]
    differ = target + [
        f"{flag} {_listed(getattr(drafter.config, f))} here, {_listed(getattr(theirs, f))} there"
        for f, flag in _WARM_START_FIELDS.items()
        if getattr(theirs, f) is not None and _listed(getattr(theirs, f)) != _listed(getattr(drafter.config, f))
        and not (upgrade and f == "drafter_type")]
    own = drafter.state_dict()
    owned = {k for k in own if head.owns_tensor(k)}
    # a block size of its own: the head's tensors of the block's shape (and so all the head's) start fresh
    reblocked = theirs.block_size != drafter.config.block_size and not upgrade and any(
        k in state and state[k].shape != own[k].shape for k in owned)
    fresh = owned if upgrade or reblocked else set()
    state = {k: v for k, v in state.items() if k not in fresh}
    trainable = {k for k, p in drafter.named_parameters() if p.requires_grad}
    wanted = {k for k in own if k not in state and k not in fresh} & trainable
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} there, {tuple(own[k].shape)} here" for k in sorted(set(state) & set(own))
              if state[k].shape != own[k].shape]
    if target:  # every tensor would differ too: the fields say why
        wanted, unexpected, shapes = set(), [], []
    if differ or wanted or unexpected or shapes:
        found = "; ".join(differ + shapes[:4] + ([f"missing {sorted(wanted)[:4]}"] if wanted else [])
                          + ([f"not in this drafter {unexpected[:4]}"] if unexpected else []))
        raise InputError(f"--init-drafter {init_dir} ({read.layout.title}) does not fit this run's drafter: {found}. "
                         f"Fix: {fix}.")
    with torch.no_grad():
        drafter.load_state_dict(state, strict=False)
    if announce is not None:
        said = [f"warm start: the drafter's {len(state)} weight tensors from {init_dir}"
                + ("" if read.layout.name == "export" else f" in {read.layout.title}")]
        if theirs.block_size != drafter.config.block_size:
            said.append(f"; block {theirs.block_size} -> {drafter.config.block_size}")
        if upgrade:
            said.append(f", a {get_head(theirs.drafter_type).title} drafter")
        if fresh:
            said.append(f": {head.title}'s {len(fresh)} tensors of its own start as they do in a fresh run "
                        f"({head.warm_start_note()}), " + ("so training starts from that drafter's predictions"
                                                          if upgrade else "as some are of the block's shape"))
        if read.dropped:
            said.append(f" (its copy of the target's {', '.join(read.dropped)} is not read)")
        if not trained_target(init_dir):
            said.append(" (its config.json records no target it was trained against, so whether that is this "
                        "run's target is not checked)")
        announce("".join(said))
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



"""Checkpoints: a directory per step, written atomically, enough to continue bit-for-bit.

RUN_DIR/checkpoints/step-000123/
  model.safetensors  the drafter's trainable weights (float32, full, names as in the export)
  optimizer.pt       the full AdamW state, keyed by parameter name (any world size loads it)
  trainer.pt         scheduler, data position, RNG states (python, numpy, torch CPU and CUDA),
                     the held-out tracker (`TrainState.state_dict`, versioned)
  meta.json          step, epoch, the run's identity (caches, target, batching, model shape),
                     its full config and the drafter's config

A checkpoint is staged in `.tmp-step-...` beside its final name, every file fsynced, then
renamed into place: a directory named step-N is always complete. Only the last
`keep_checkpoints` are kept, and the one of the best held-out evaluation. Rank 0 writes;
other ranks wait at a barrier.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from dflash.cache_tools.identity import unrecorded_weights_note
from dflash.cache_tools.manifest import value_differences
from dflash.runtime.errors import CorruptDataError, InputError
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import remove_dir, staged_dir, sweep_stale_temps
from dflash.runtime.locks import OutputIsInputError, inside, output_lock, same_path
from dflash.runtime.safetensors_files import check_safetensors
from dflash.train.config import DrafterSettings, ResumeMismatchError, TrainConfigError
from dflash.train.exports.export import export_drafter, export_out_dir
from dflash.train.heads import get_head, head_names
from dflash.train.model.drafter_config import DrafterConfig
from dflash.train.run.distributed import DistInfo, barrier, full_state, load_full_state
from safetensors.torch import load_file, save_file
from torch import nn

CHECKPOINT_VERSION = 1
TRAIN_STATE_VERSION = 2
"""trainer.pt's layout: 2 records its version; 1 (no version key: every checkpoint before it) holds
the same keys, and meta.json held a second copy of the loader's position, which is not read."""


class CheckpointCorruptError(CorruptDataError):
    """A checkpoint's files cannot be read, or hold something dflash-train never writes there."""


CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, META_FILE = "model.safetensors", "optimizer.pt", "trainer.pt", "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    """A checkpoint read back from disk."""

    path: Path
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def state(self) -> dict[str, Any]:
        """Its `TrainState.state_dict` (a version-1 trainer.pt has no version key, the same keys)."""
        return {"version": 1, **self.trainer, "step": self.step, "identity": self.meta.get("identity") or {},
                "model": self.model, "optimizer": self.optimizer}


def step_dir_name(step: int | None) -> str:
    return f"step-{step:06d}" if step is not None else ""


def _plain(value: Any) -> Any:
    """numpy arrays and scalars as tensors and Python numbers: what `torch.load(weights_only=True)` reads."""
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def compute_settings() -> dict[str, Any]:
    """What decides the bits of a step besides the data and the state: the same values are
    needed for a resumed run to continue bit-identically (each makes kernels sum in another order)."""
    settings: dict[str, Any] = {"torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
                                "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        settings["cuda_device"] = torch.cuda.get_device_name()
    return settings


def compute_changes(saved: dict[str, Any] | None) -> Finding | None:
    """A notice when this process computes otherwise than the one that wrote a checkpoint."""
    if not saved:
        return None
    now = compute_settings()
    if "cuda_device" in now:  # a GPU run: the CPU's threads and kernels do not decide its bits
        now = {k: v for k, v in now.items() if not k.startswith("cpu_")}
    changes = [[k, saved.get(k), v] for k, v in now.items() if saved.get(k) != v]
    return Finding("train.resume-compute-changed", changes=changes) if changes else None


def capture_rng() -> dict[str, Any]:
    """The RNG states as plain data (tensors, numbers, str, tuples, dicts)."""
    return {
        "python": random.getstate(),
        "numpy": _plain(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = dict(state["numpy"])
    np_state["state"] = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in np_state["state"].items()}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"] and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Everything that decides a run's next batch and its continuation, saved as one checkpoint and
    loaded back as one: the step, the drafter's weights and the optimizer's state (gathered whole
    under FSDP), the schedule, the loader's position, the RNG streams, the best held-out evaluation
    so far (`heldout`, which also picks the exported step) and the run's identity (what a resumed
    run must share with it: `check_resume`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler
    loader: Any  # a TrainLoader: its state_dict is the data position, its epoch goes to meta.json
    heldout: Any  # a HeldoutTracker: state_dict, summary(step) for meta.json, best_step
    identity: dict[str, Any] = field(default_factory=dict)
    step: int = 0

    def state_dict(self, info: DistInfo) -> dict[str, Any]:
        """Collective under FSDP (every rank calls it): rank 0 gets the weights, others empty dicts."""
        model_state, optim_state = full_state(self.model, self.optimizer, info)
        return {"version": TRAIN_STATE_VERSION, "step": self.step, "identity": self.identity,
                "model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict(), "rng": capture_rng(), "heldout": self.heldout.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `Checkpoint.state()`); the identity is checked before (`check_resume`)."""
        version = state.get("version", 1)
        if version not in (1, TRAIN_STATE_VERSION):
            raise ResumeMismatchError(Finding("train.trainer-state-version", version=version,
                                              current=TRAIN_STATE_VERSION))
        load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        restore_rng(state["rng"])
        if state.get("heldout") is not None:  # (checkpoints from before the held-out tracker have none)
            self.heldout.load_state_dict(state["heldout"])
        self.step = int(state["step"])


_TRAINER_KEYS = ("version", "scheduler", "loader", "rng", "heldout")
"""What of a TrainState goes to trainer.pt (the weights have their own files, step and identity meta.json)."""


class Checkpointer:
    """Writes, lists, prunes and reads the checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, *, keep_checkpoints: int = 3):
        if keep_checkpoints < 1:
            raise TrainConfigError(Finding("train.keep-checkpoints-too-low", value=keep_checkpoints))
        self.keep_checkpoints = keep_checkpoints
        """The most recent checkpoints kept (older ones are deleted, except the best one)."""
        self.dir = Path(run_dir) / CHECKPOINTS_DIR
        self.best_step: int | None = None
        """The step of the best held-out evaluation: its checkpoint outlives the rotation."""

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def remove_stale(self) -> None:
        """Delete staging directories left by a killed run (call before writing, on rank 0)."""
        sweep_stale_temps(self.dir)

    def save(self, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
             trainer_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        final = self.dir / f"step-{step:06d}"
        # Staged beside its final name, fsynced, renamed into place (`runtime.fsio.staged_dir`);
        # the same step written again (e.g. a signal right after a resume) replaces it.
        with staged_dir(final) as stage:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
            save_file(tensors, str(stage / MODEL_FILE), metadata={"format": "pt"})
            torch.save(optim_state, stage / OPTIMIZER_FILE)
            torch.save(_plain(trainer_state), stage / TRAINER_FILE)  # read back with weights_only
            meta = {"version": CHECKPOINT_VERSION, "step": step, "time": time.time(),
                    "compute": compute_settings(), **meta}
            (stage / META_FILE).write_text(json.dumps(meta, indent=1, default=str) + "\n")
        self.prune()
        return final

    def save_state(self, state: TrainState, info: DistInfo, about: dict[str, Any]) -> Path | None:
        """Checkpoint `state` at its step (collective under FSDP: every rank calls it; rank 0 writes,
        the others wait). `about`: what meta.json records of the run besides the state (its config)."""
        full = state.state_dict(info)
        path = None
        if info.is_main:
            meta = {"epoch": state.loader.epoch, "identity": state.identity, **about,
                    "heldout": state.heldout.summary(state.step)}
            path = self.save(state.step, full["model"], full["optimizer"],
                             {k: full[k] for k in _TRAINER_KEYS}, meta)
        barrier(info)
        return path

    def restore(self, state: TrainState, path: Path, identity: dict[str, Any]
                ) -> tuple[Checkpoint, list[Finding]]:
        """Load checkpoint `path` into `state` after checking it is this run's (`check_resume`:
        refused otherwise); returns it and the notices of the check."""
        ckpt = self.load(path)
        notes = check_resume(ckpt.meta["identity"], identity, path)
        state.load_state_dict(ckpt.state())
        self.best_step = state.heldout.best_step
        return ckpt, notes

    def prune(self) -> None:
        """Delete all but the last `keep_checkpoints`, and never the best one (`best_step`)."""
        for old in self.complete()[:-self.keep_checkpoints]:
            if old.name == step_dir_name(self.best_step):
                continue
            remove_dir(old)  # renamed first: a half-deleted one never looks like a complete checkpoint

    def load(self, path: Path) -> Checkpoint:
        try:
            meta = json.loads((path / META_FILE).read_text())
            if meta.get("version") != CHECKPOINT_VERSION:
                raise ResumeMismatchError(Finding("train.checkpoint-version", checkpoint=str(path),
                                                  version=meta.get("version"), current=CHECKPOINT_VERSION))
            check_safetensors(path / MODEL_FILE, purpose="resume")
            model = load_file(str(path / MODEL_FILE))
            optimizer = _load_plain(path / OPTIMIZER_FILE)
            trainer = _load_plain(path / TRAINER_FILE)
        except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as e:
            raise CheckpointCorruptError(Finding("train.checkpoint-unreadable", checkpoint=str(path),
                                                 error=str(e))) from e
        return Checkpoint(path=path, meta=meta, model=model, optimizer=optimizer, trainer=trainer)


class RunCheckpoints:
    """A run's checkpoints of its TrainState: when to write one (`save`, `save_unless_saved`),
    what comes before (`guard`: never a checkpoint of nan weights) and after (`after_save`), and
    the newest one."""

    def __init__(self, checkpoints: Checkpointer, state: TrainState, info: DistInfo, about: dict[str, Any], *,
                 guard: Callable[[int], None], announce: Callable[[str], None],
                 after_save: Callable[[], None] = lambda: None):
        self.checkpoints, self.state, self.info, self.about = checkpoints, state, info, about
        self.guard, self.announce, self.after_save = guard, announce, after_save
        self.last: Path | None = checkpoints.latest()
        """The newest checkpoint (the one resumed from, or none yet)."""
        self.saved_step = state.step if state.step else -1

    def save(self) -> Path | None:
        self.guard(self.state.step)
        path = self.checkpoints.save_state(self.state, self.info, self.about)
        if path is not None:
            self.announce(f"checkpoint: {path}")
        self.after_save()
        self.last, self.saved_step = path, self.state.step
        return path

    def save_unless_saved(self) -> Path | None:
        """Save the current step unless its checkpoint is already written."""
        if self.saved_step != self.state.step:
            self.save()
        return self.last

    def due(self, save_interval: int) -> bool:
        return bool(save_interval) and self.state.step % save_interval == 0


def _load_plain(file: Path) -> Any:
    """`torch.load` of plain data only: a pickled object (which could run code) is refused."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise CheckpointCorruptError(Finding("train.checkpoint-pickled", file=str(file), checkpoint=str(file.parent),
                                             pickled=found.group(1) if found else None)) from None


def check_resume(saved_identity: dict[str, Any], identity: dict[str, Any], path: Path) -> list[Finding]:
    """Refuse to continue a checkpoint whose data, target or model shape differ from this run's,
    naming the keys that differ; returns notices (a checkpoint written before the target's
    weights were hashed resumes, unchecked)."""
    current = json.loads(json.dumps(identity, default=str))
    notes = []
    saved_target, target = saved_identity.get("target") or {}, current.get("target") or {}
    if (note := unrecorded_weights_note(saved_target, target, purpose="checkpoint", path=str(path))) is not None:
        notes.append(note)
        current["target"] = {k: v for k, v in target.items() if k != "weights_hash"}
    diffs = value_differences(saved_identity, current)  # [key, the checkpoint's, this run's]
    if diffs:
        grown = any(key.startswith("caches[") and key.endswith((".samples", ".tokens")) for key, _, _ in diffs)
        # (a run identity without drafter_type is a DFlash drafter's: heads.get_head(None))
        was = (saved_identity.get("model") or {}).get("drafter_type")
        now = (current.get("model") or {}).get("drafter_type")
        default_changed = (was != now and now == DrafterSettings.drafter_type  # the default became `now` since
                           and (was is None or was in head_names()))
        raise ResumeMismatchError(Finding(
            "train.resume-other-run", checkpoint=str(path), differences=diffs, grown=grown,
            default_head=[get_head(was).name, get_head(now).name] if default_changed else None))
    return notes


class _ExportView:
    """The two things `export_drafter` reads from a drafter: its config and its weights."""

    def __init__(self, config: DrafterConfig, state: dict[str, torch.Tensor]):
        self.config, self._state = config, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def export_from_state(drafter_config: DrafterConfig, model_state: dict[str, torch.Tensor], out_dir: Path,
                      dtype: torch.dtype = torch.bfloat16, *, training_target: dict[str, Any] | None = None) -> Path:
    """Export full trainable weights (from a checkpoint or `full_state`) as an HF drafter directory."""
    return export_drafter(_ExportView(drafter_config, model_state), out_dir, dtype=dtype,  # type: ignore[arg-type]
                          training_target=training_target)


RECIPE_KEYS = ("drafter_type", "num_draft_layers", "epochs", "max_steps", "lr", "lr_schedule", "warmup_ratio",
               "max_anchors", "loss_weighting", "gamma", "soft_label_weight", "hard_label", "noise_type", "seed")
"""The settings of a run its export's model card names (train/exports/model_card.py)."""


def training_target(meta: dict[str, Any], exported_step: int | None = None) -> dict[str, Any] | None:
    """What an export records of the run behind it (its checkpoint's meta.json): the target it
    trained against ({"target": identity, "target_path"}, read by dflash-eval and --init-drafter),
    and for its model card ("run") the data, the recipe, the steps trained and the step whose weights
    are exported (`exported_step`, default the checkpoint's), and the held-out estimate."""
    identity = meta.get("identity") or {}
    target = identity.get("target")
    if not target:
        return None
    config = meta.get("config") or {}
    path = config.get("target_model")
    caches = identity.get("caches") or []
    run: dict[str, Any] = {
        "steps": meta.get("step"),
        "exported_step": meta.get("step") if exported_step is None else exported_step,
        "data": {"samples": sum(int(c.get("samples", 0)) for c in caches),
                 "tokens": sum(int(c.get("tokens", 0)) for c in caches),
                 "caches": [f"{(c.get('identity') or {}).get('data', {}).get('name', '?')} "
                            f"({(c.get('identity') or {}).get('hidden', {}).get('codec', {}).get('name', '?')})"
                            for c in caches]},
        "recipe": {k: config[k] for k in RECIPE_KEYS if config.get(k) not in (None, 0) or k == "seed"},
        "heldout": meta.get("heldout") or {},
    }
    if path and (name := _hub_name(Path(path))) is not None:
        run["target_name_or_path"] = name
    return {"target": target, **({"target_path": str(Path(path).resolve())} if path else {}), "run": run}


def _hub_name(target_dir: Path) -> str | None:
    """The `_name_or_path` the target's own config.json records, if any (a Hub id, for the card)."""
    try:
        name = json.loads((target_dir / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`dflash-train export`: a checkpoint directory -> an HF drafter directory (no target needed)."""
    path = Path(checkpoint_dir)
    if not (path / META_FILE).is_file() and (path / CHECKPOINTS_DIR).is_dir():
        latest = Checkpointer(path).latest()
        if latest is None:
            raise InputError(Finding("train.export-no-checkpoint", run_dir=str(path)))
        path = latest
    if not (path / META_FILE).is_file() or not (path / MODEL_FILE).is_file():
        raise InputError(Finding("train.export-not-checkpoint", path=str(path), needs=[META_FILE, MODEL_FILE]))
    out = Path(out_dir)
    if inside(path, out):  # publishing the export would swap the checkpoint (or its run) out and delete it
        raise OutputIsInputError(Finding("train.export-out-is-checkpoint", out=str(out), checkpoint=str(path),
                                         same=same_path(path, out)))
    out = export_out_dir(out, purpose="command")  # only an empty directory or an earlier export is replaced
    meta = json.loads((path / META_FILE).read_text())
    config = DrafterConfig(**{"drafter_type": "dflash", **meta["drafter_config"]})  # older runs were DFlash
    check_safetensors(path / MODEL_FILE, purpose="export")
    with output_lock(out, purpose="export"):
        return export_from_state(config, load_file(str(path / MODEL_FILE)), out, dtype,
                                 training_target=training_target(meta))

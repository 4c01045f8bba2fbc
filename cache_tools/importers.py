"""Other trainers' hidden-state directories, read as samples: one `SampleSource` per format.

`dflash-cache import` (cache_tools/importing.py) turns such a directory into a cache of ours. A
format is one registered subclass (`register_source`): it lists the directory's sample files in
sample order (`scan`) and reads one of them (`read`) as token ids, loss mask and the captured
layers' hidden states [T, slots * D], checking what it reads and naming the file and the key it
cannot interpret. The importer does the rest (layer ids, widths, token counts, vocabulary, parts,
plan, commit) the same way for every format. The facts each format rests on, and where they were
read, are in docs/cache-tools.md ("Importing another trainer's hidden states").

torch is imported where a file is read, never when this module is imported: `--help` and the
format names stay torch-free.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from dflash.runtime.findings import Finding

from .errors import CacheError


class ImportSourceError(CacheError):
    """A source directory cannot be imported as it is (no sample files, a missing dataset, a
    format that is not registered)."""


class BadSampleFile(ImportSourceError):
    """One sample file cannot be interpreted: `path` names it, `key` the entry (None: the file as a
    whole), `problem` what is wrong with it (a finding's code: its fields `file`, `key` and values).

    Built from a `Finding` (`BadSampleFile(Finding("cache.sample-...", file=..., key=..., ...))`);
    the old form `BadSampleFile(path, key, problem, fix)` reads as text."""

    def __init__(self, path: Path | Finding, key: str | None = None, problem: str = "", fix: str = ""):
        if isinstance(path, Finding):
            self.path, self.key, self.problem = Path(path.fields["file"]), path.fields.get("key"), path.code
            super().__init__(path)
            return
        self.path, self.key, self.problem = Path(path), key, problem
        where = f"{path}" + (f", key {key!r}" if key else "")
        super().__init__(f"{where}: {problem}." + (f" {fix}" if fix else ""))


@dataclass(frozen=True)
class SampleFile:
    """One sample of a source: its id (the source's own index of it) and the file that holds it."""

    sample_id: int
    path: Path


@dataclass
class RawSample:
    """One sample as a source stores it. `hidden` is [T, width] (the captured layers' states
    side by side, layer-major, in the source's slot order), None when only its shape was read
    (`rows`, `width`); `layer_ids` are the source's own numbers of its slots where the file names
    them (None: it does not)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    rows: int
    width: int
    hidden: Any = None  # torch.Tensor
    layer_ids: list[int] | None = None
    slot_width: int | None = None  # the width of one slot, where the file keeps its slots apart


@dataclass
class SampleSource:
    """A peer's hidden-state directory. Subclasses set the class attributes and implement
    `scan` and `read`.

    `layer_offset`: the source numbers our layer id l (the output of decoder layer l, HF
    `hidden_states[l + 1]`) as l + layer_offset. `final_slot`: its files may hold, as their last
    slot, the last decoder layer's output before the final norm (the source's id N for an N-layer
    target), which a cache stores as `last_hidden`. `notes`: what `scan` left out and why, for
    the import's summary."""

    name: ClassVar[str] = ""
    layer_offset: ClassVar[int] = 0
    final_slot: ClassVar[bool] = False
    layer_ids_help: ClassVar[str] = ""

    src: Path
    notes: list[Finding] = field(default_factory=list)

    def scan(self) -> list[SampleFile]:
        """The sample files in sample-id order; raises ImportSourceError when there are none."""
        raise NotImplementedError

    def read(self, sample: SampleFile, *, shape_only: bool = False) -> RawSample:
        """One sample; `shape_only` reads the ids, the mask and the hidden state's shape only
        (cheap where the format allows). Raises BadSampleFile naming the file and key."""
        raise NotImplementedError

    def provenance(self) -> dict[str, Any]:
        """What the import records about the source (header provenance)."""
        return {"format": self.name, "source": str(self.src.resolve())}


SOURCES: dict[str, type[SampleSource]] = {}


def register_source(cls: type[SampleSource]) -> type[SampleSource]:
    """Register a format under `cls.name` (a class decorator); a name is registered once."""
    if not cls.name or cls.name in SOURCES and SOURCES[cls.name] is not cls:
        raise ValueError(f"sample source name {cls.name!r} is empty or already registered")
    SOURCES[cls.name] = cls
    return cls


def source_for(name: str, src: str | Path) -> SampleSource:
    """The registered source `name` over the directory `src`."""
    if name not in SOURCES:
        raise ImportSourceError(Finding("cache.import-format-unknown", format=name, formats=sorted(SOURCES)))
    path = Path(src)
    if not path.is_dir():
        raise ImportSourceError(Finding("cache.import-source-not-dir", src=str(path), format=name))
    return SOURCES[name](path)


# -- reading helpers ----------------------------------------------------------------------------


def _torch():
    import torch

    return torch


FLOAT_DTYPES = ("bfloat16", "float16", "float32")
"""Hidden-state dtypes an import reads (bf16 is stored bit for bit; the others are rounded to bf16
as an extraction stores them)."""


def _token_vector(value: Any, path: Path, key: str) -> np.ndarray:
    """A [T] (or [1, T]) integer tensor as int64 numpy."""
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise BadSampleFile(Finding("cache.sample-not-tensor", file=str(path), key=key, got=type(value).__name__))
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1:
        raise BadSampleFile(Finding("cache.sample-token-shape", file=str(path), key=key, shape=list(value.shape)))
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise BadSampleFile(Finding("cache.sample-token-dtype", file=str(path), key=key,
                                    dtype=str(value.dtype).removeprefix("torch.")))
    return value.to(torch.int64).numpy()


def _hidden_matrix(value: Any, path: Path, key: str) -> Any:
    """A [T, W] (or [1, T, W]) floating tensor."""
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise BadSampleFile(Finding("cache.sample-not-tensor", file=str(path), key=key, got=type(value).__name__))
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2:
        raise BadSampleFile(Finding("cache.sample-hidden-shape", file=str(path), key=key, shape=list(value.shape)))
    _check_float(str(value.dtype).removeprefix("torch."), path, key)
    return value


def _check_float(dtype: str, path: Path, key: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise BadSampleFile(Finding("cache.sample-hidden-dtype", file=str(path), key=key, dtype=dtype,
                                    dtypes=list(FLOAT_DTYPES)))


# -- SpecForge ----------------------------------------------------------------------------------


_SPECFORGE_NAME = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")


@register_source
@dataclass
class SpecForgeSource(SampleSource):
    """SpecForge's offline features (scripts/prepare_hidden_states.py): one torch.save'd dict per
    sample, `rows_<g>-<g+G>/data_<index>.ckpt` (`.ckpt.gz`: gzip of the same bytes). DFlash,
    DSpark and Domino store the captured layers as `hidden_states` [1, T, K*D], EAGLE3 as
    `aux_hidden_state`; `input_ids` and `loss_mask` [T] beside them. Layer ids: the draft config's
    `dflash_config.target_layer_ids`, the same numbering as ours (SGLang captures before layer
    id + 1); the files do not record them."""

    name: ClassVar[str] = "specforge"
    layer_offset: ClassVar[int] = 0
    final_slot: ClassVar[bool] = False
    layer_ids_help: ClassVar[str] = ("the draft config's dflash_config.target_layer_ids that prepare_hidden_states.py "
                                     "captured (EAGLE3: eagle_aux_hidden_state_layer_ids, by default 1, N/2-1, N-4)")
    HIDDEN_KEYS: ClassVar[tuple[str, ...]] = ("hidden_states", "aux_hidden_state")

    def scan(self) -> list[SampleFile]:
        found: dict[int, Path] = {}
        for path in sorted(self.src.rglob("data_*.ckpt*")):
            match = _SPECFORGE_NAME.match(path.name)
            if match is None or not path.is_file():
                continue
            index = int(match.group(1))
            if index in found:
                raise ImportSourceError(Finding("cache.specforge-duplicate-sample", file=str(path),
                                                other=str(found[index]), sample=index))
            found[index] = path
        if not found:
            raise ImportSourceError(Finding("cache.specforge-no-files", src=str(self.src)))
        return [SampleFile(i, found[i]) for i in sorted(found)]

    def _load(self, path: Path, *, lazy: bool) -> dict[str, Any]:
        torch = _torch()
        try:
            if path.name.endswith(".gz"):
                with gzip.open(path, "rb") as fh:
                    data = fh.read()
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            else:
                try:  # memory-mapped: the ids and the shapes without reading the hidden states
                    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=lazy)
                except RuntimeError:
                    if not lazy:
                        raise
                    obj = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, EOFError, RuntimeError, ValueError) as e:
            raise BadSampleFile(Finding("cache.sample-not-torch-save", file=str(path), key=None,
                                        error=(str(e).splitlines() or [""])[0])) from e
        except pickle.UnpicklingError as e:  # weights_only refuses anything but tensors and plain containers
            raise BadSampleFile(Finding("cache.sample-not-tensors", file=str(path), key=None,
                                        error=(str(e).splitlines() or [""])[0])) from e
        if not isinstance(obj, dict):
            raise BadSampleFile(Finding("cache.sample-not-dict", file=str(path), key=None, got=type(obj).__name__))
        return obj

    def read(self, sample: SampleFile, *, shape_only: bool = False) -> RawSample:
        path = sample.path
        obj = self._load(path, lazy=shape_only)
        keys = [k for k in self.HIDDEN_KEYS if k in obj]
        missing = [k for k in ("input_ids", "loss_mask") if k not in obj]
        if missing or len(keys) != 1:
            raise BadSampleFile(Finding("cache.specforge-keys", file=str(path), key=None, missing=missing,
                                        hidden=keys, expected=list(self.HIDDEN_KEYS), keys=sorted(map(str, obj))))
        hidden = _hidden_matrix(obj[keys[0]], path, keys[0])
        out = RawSample(_token_vector(obj["input_ids"], path, "input_ids"),
                        _token_vector(obj["loss_mask"], path, "loss_mask"),
                        rows=int(hidden.shape[0]), width=int(hidden.shape[1]))
        if not shape_only:
            out.hidden = hidden.contiguous()
        return out


# -- speculators --------------------------------------------------------------------------------


_SPECULATORS_NAME = re.compile(r"^hs_(\d+)\.safetensors$")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32"}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file (name -> dtype, shape, data_offsets), checked against the
    file's size: a truncated file is named here, before any tensor is read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > 100_000_000:
                raise ValueError(f"its header length {size} is not plausible")
            header = json.loads(fh.read(size))
            total = fh.seek(0, 2)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadSampleFile(Finding("cache.safetensors-unreadable", file=str(path), key=None, error=str(e))) from e
    if not isinstance(header, dict):
        raise BadSampleFile(Finding("cache.safetensors-not-object", file=str(path), key=None))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values() if isinstance(v, dict)), default=0)
    if 8 + size + end > total:
        raise BadSampleFile(Finding("cache.safetensors-truncated", file=str(path), key=None, size=total,
                                    promised=8 + size + end))
    return header


def _read_arrow_dataset(directory: Path) -> Any:
    """The pyarrow table of a `datasets` save_to_disk directory (memory-mapped, zero-copy)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportSourceError(Finding("cache.pyarrow-missing", src=str(directory))) from None
    state_path = directory / "state.json"
    try:
        state = json.loads(state_path.read_text())
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except FileNotFoundError:
        raise ImportSourceError(Finding("cache.speculators-no-state", src=str(directory))) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImportSourceError(Finding("cache.speculators-state-files", file=str(state_path), error=str(e))) from e
    if state.get("_indices_data_files"):
        raise ImportSourceError(Finding("cache.speculators-indices", file=str(state_path)))
    tables = []
    for path in files:
        try:
            source = pa.memory_map(str(path))
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                tables.append(pa.ipc.open_file(source).read_all())
        except (OSError, pa.ArrowException) as e:
            raise ImportSourceError(Finding("cache.arrow-unreadable", file=str(path), error=str(e))) from e
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0] if tables else None
    missing = [] if table is None else [c for c in ("input_ids", "loss_mask") if c not in table.column_names]
    if table is None or missing:
        raise ImportSourceError(Finding("cache.speculators-columns", src=str(directory), missing=missing,
                                        columns=[] if table is None else list(table.column_names)))
    return table


@register_source
@dataclass
class SpeculatorsSource(SampleSource):
    """speculators' offline data (scripts/prepare_data.py, then data_generation_offline.py): a
    `datasets` directory (input_ids, loss_mask, seq_len per row) whose `hidden_states/` holds
    `hs_<row>.safetensors`, written by vLLM's hidden-states connector: `hidden_states` [T, L, D]
    and `token_ids` [T]. vLLM's layer index i is the state before decoder layer i (HF
    `hidden_states[i]`), our id i - 1; index N (appended by launch_vllm.py unless
    --no-include-last-layer) is the last layer's output before the final norm."""

    name: ClassVar[str] = "speculators"
    layer_offset: ClassVar[int] = 1
    final_slot: ClassVar[bool] = True
    layer_ids_help: ClassVar[str] = ("the layer ids vLLM captured: launch_vllm.py's --target-layer-ids (by default "
                                     "2, N/2, N-3) with the N it appends")
    _table: Any = None

    @property
    def hidden_dir(self) -> Path:
        return self.src / "hidden_states"

    def scan(self) -> list[SampleFile]:
        self._table = _read_arrow_dataset(self.src)
        rows = self._table.num_rows
        found: dict[int, Path] = {}
        if self.hidden_dir.is_dir():
            for path in self.hidden_dir.iterdir():
                match = _SPECULATORS_NAME.match(path.name)
                if match is not None and path.is_file():
                    found[int(match.group(1))] = path
        if not found:
            raise ImportSourceError(Finding("cache.speculators-no-files", src=str(self.hidden_dir)))
        beyond = sorted(i for i in found if i >= rows)
        if beyond:
            raise ImportSourceError(Finding("cache.speculators-row-beyond", file=str(found[beyond[0]]), row=beyond[0],
                                            src=str(self.src), rows=rows, files=len(beyond)))
        if len(found) < rows:
            self.notes.append(Finding("cache.import-rows-without-file", missing=rows - len(found), rows=rows,
                                      src=str(self.hidden_dir)))
        return [SampleFile(i, found[i]) for i in sorted(found)]

    def _row(self, row: int, name: str, path: Path) -> np.ndarray:
        values = self._table.column(name)[row].values
        if values is None:
            raise BadSampleFile(Finding("cache.sample-row-missing", file=str(path), key=name, row=row, src=str(self.src)))
        return np.asarray(values.to_numpy(zero_copy_only=False)).astype(np.int64, copy=False)

    def read(self, sample: SampleFile, *, shape_only: bool = False) -> RawSample:
        path = sample.path
        if path.with_name(path.name + ".lock").exists():
            raise BadSampleFile(Finding("cache.sample-being-written", file=str(path), key=None))
        header = safetensors_header(path)
        for key in ("hidden_states", "token_ids"):
            if not isinstance(header.get(key), dict):
                raise BadSampleFile(Finding("cache.sample-lacks-key", file=str(path), key=None, lacks=key,
                                            keys=sorted(k for k in header if k != "__metadata__")))
        shape = [int(x) for x in header["hidden_states"]["shape"]]
        _check_float(_SAFETENSORS_DTYPES.get(header["hidden_states"]["dtype"], header["hidden_states"]["dtype"]),
                     path, "hidden_states")
        if len(shape) != 3:
            raise BadSampleFile(Finding("cache.sample-hidden-3d", file=str(path), key="hidden_states", shape=shape))
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as fh:
                token_ids = _token_vector(fh.get_tensor("token_ids"), path, "token_ids")
                hidden = None if shape_only else fh.get_tensor("hidden_states")
        except (OSError, RuntimeError, ValueError) as e:
            raise BadSampleFile(Finding("cache.sample-unreadable", file=str(path), key=None, error=str(e))) from e
        input_ids = self._row(sample.sample_id, "input_ids", path)
        if not np.array_equal(token_ids, input_ids):
            raise BadSampleFile(Finding("cache.sample-token-ids-mismatch", file=str(path), key="token_ids",
                                        tokens=len(token_ids), row=sample.sample_id, row_tokens=len(input_ids)))
        out = RawSample(input_ids, self._row(sample.sample_id, "loss_mask", path), rows=shape[0], width=shape[1] * shape[2],
                        slot_width=shape[2])
        if hidden is not None:
            out.hidden = hidden.reshape(shape[0], shape[1] * shape[2])
        return out


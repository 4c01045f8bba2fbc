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

from .errors import CacheError


class ImportSourceError(CacheError):
    """A source directory cannot be imported as it is (no sample files, a missing dataset, a
    format that is not registered)."""


class BadSampleFile(ImportSourceError):
    """One sample file cannot be interpreted: `path` names it, `key` the entry (None: the file as a
    whole), `problem` what is wrong with it."""

    def __init__(self, path: Path, key: str | None, problem: str, fix: str = ""):
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
    notes: list[str] = field(default_factory=list)

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
        raise ImportSourceError(f"--format {name!r} is not a format dflash-cache import reads: use one of "
                                f"{', '.join(sorted(SOURCES))}.")
    path = Path(src)
    if not path.is_dir():
        raise ImportSourceError(f"{path} is not a directory: point dflash-cache import at the {name} output directory.")
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
        raise BadSampleFile(path, key, f"is a {type(value).__name__}, not a tensor")
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1:
        raise BadSampleFile(path, key, f"has shape {list(value.shape)}, not [tokens] (or [1, tokens])")
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise BadSampleFile(path, key, f"holds {str(value.dtype).removeprefix('torch.')} values, not integers")
    return value.to(torch.int64).numpy()


def _hidden_matrix(value: Any, path: Path, key: str) -> Any:
    """A [T, W] (or [1, T, W]) floating tensor."""
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise BadSampleFile(path, key, f"is a {type(value).__name__}, not a tensor")
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2:
        raise BadSampleFile(path, key, f"has shape {list(value.shape)}, not [tokens, width] (or [1, tokens, width])")
    _check_float(str(value.dtype).removeprefix("torch."), path, key)
    return value


def _check_float(dtype: str, path: Path, key: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise BadSampleFile(path, key, f"holds {dtype} values; an import reads {', '.join(FLOAT_DTYPES)} hidden "
                                       "states (a quantized format needs its scales, which this file does not name)")


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
                raise ImportSourceError(
                    f"{found[index]} and {path} both hold sample {index}: SpecForge writes one file per sample "
                    "(a run with and one without --compress wrote the same directory?). Remove one of them.")
            found[index] = path
        if not found:
            raise ImportSourceError(
                f"{self.src} holds no SpecForge feature files (data_<index>.ckpt or .ckpt.gz, below rows_* "
                "directories): point at the --output-path of scripts/prepare_hidden_states.py.")
        return [SampleFile(i, found[i]) for i in sorted(found)]

    def _load(self, path: Path, *, lazy: bool) -> dict[str, Any]:
        torch = _torch()
        fix = "Regenerate it with prepare_hidden_states.py, or pass --skip-bad to leave it out."
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
            raise BadSampleFile(path, None, f"cannot be read as a torch.save file ({str(e).splitlines()[0]})",
                                fix) from e
        except pickle.UnpicklingError as e:  # weights_only refuses anything but tensors and plain containers
            raise BadSampleFile(path, None, "holds objects other than tensors (torch.load(weights_only=True) "
                                            f"refused it: {str(e).splitlines()[0]})", fix) from e
        if not isinstance(obj, dict):
            raise BadSampleFile(path, None, f"holds a {type(obj).__name__}, not a dict of tensors", fix)
        return obj

    def read(self, sample: SampleFile, *, shape_only: bool = False) -> RawSample:
        path = sample.path
        obj = self._load(path, lazy=shape_only)
        keys = [k for k in self.HIDDEN_KEYS if k in obj]
        missing = [k for k in ("input_ids", "loss_mask") if k not in obj]
        if missing or len(keys) != 1:
            what = (f"lacks {missing}" if missing else
                    f"holds both {keys}" if keys else f"holds none of {list(self.HIDDEN_KEYS)}")
            raise BadSampleFile(path, None, f"{what} (its keys: {sorted(map(str, obj))}): it is not a SpecForge "
                                            "DFlash/DSpark/Domino or EAGLE3 feature file")
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
        raise BadSampleFile(path, None, f"is not a readable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise BadSampleFile(path, None, "is not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values() if isinstance(v, dict)), default=0)
    if 8 + size + end > total:
        raise BadSampleFile(path, None, f"is truncated ({total:,} bytes, its header promises {8 + size + end:,})")
    return header


def _read_arrow_dataset(directory: Path) -> Any:
    """The pyarrow table of a `datasets` save_to_disk directory (memory-mapped, zero-copy)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportSourceError(
            f"{directory} is a speculators dataset (Arrow files), and reading it needs pyarrow, which is not "
            "installed. Install it with `pip install 'dflash-pipeline[parquet]'` (or `pip install pyarrow`).") from None
    state_path = directory / "state.json"
    try:
        state = json.loads(state_path.read_text())
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except FileNotFoundError:
        raise ImportSourceError(
            f"{directory} holds no state.json: a speculators import reads the dataset written by prepare_data.py "
            "(its --output, the directory whose hidden_states/ holds the hs_<index>.safetensors files).") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImportSourceError(f"{state_path} does not list the dataset's Arrow files ({e}).") from e
    if state.get("_indices_data_files"):
        raise ImportSourceError(f"{state_path} maps its rows through an indices file, which the import does not "
                                "read: save the dataset again with save_to_disk (it writes the rows in order).")
    tables = []
    for path in files:
        try:
            source = pa.memory_map(str(path))
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                tables.append(pa.ipc.open_file(source).read_all())
        except (OSError, pa.ArrowException) as e:
            raise ImportSourceError(f"{path}: cannot read the dataset's Arrow file ({e}).") from e
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0] if tables else None
    missing = [] if table is None else [c for c in ("input_ids", "loss_mask") if c not in table.column_names]
    if table is None or missing:
        raise ImportSourceError(f"{directory}: the dataset has no {missing or 'rows'} "
                                f"(columns: {[] if table is None else table.column_names}).")
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
            raise ImportSourceError(
                f"{self.hidden_dir} holds no hs_<row>.safetensors files: point at the dataset directory whose "
                "hidden_states/ data_generation_offline.py filled (its default --output).")
        beyond = sorted(i for i in found if i >= rows)
        if beyond:
            raise ImportSourceError(
                f"{found[beyond[0]]} is the hidden states of row {beyond[0]}, but the dataset at {self.src} has "
                f"{rows} rows ({len(beyond)} such file(s)): the files were generated from another dataset.")
        if len(found) < rows:
            self.notes.append(f"{rows - len(found):,} of the dataset's {rows:,} rows have no hidden-state file "
                              "(not generated: --max-samples, or requests that failed): they are not imported.")
        return [SampleFile(i, found[i]) for i in sorted(found)]

    def _row(self, row: int, name: str, path: Path) -> np.ndarray:
        values = self._table.column(name)[row].values
        if values is None:
            raise BadSampleFile(path, name, f"is missing from row {row} of the dataset at {self.src}")
        return np.asarray(values.to_numpy(zero_copy_only=False)).astype(np.int64, copy=False)

    def read(self, sample: SampleFile, *, shape_only: bool = False) -> RawSample:
        path = sample.path
        if path.with_name(path.name + ".lock").exists():
            raise BadSampleFile(path, None, "is still being written (its .lock file is there)",
                                "Wait for data_generation_offline.py to finish, or pass --skip-bad to leave it out.")
        header = safetensors_header(path)
        for key in ("hidden_states", "token_ids"):
            if not isinstance(header.get(key), dict):
                raise BadSampleFile(path, None, f"lacks {key!r} (its keys: {sorted(k for k in header if k != '__metadata__')})")
        shape = [int(x) for x in header["hidden_states"]["shape"]]
        _check_float(_SAFETENSORS_DTYPES.get(header["hidden_states"]["dtype"], header["hidden_states"]["dtype"]),
                     path, "hidden_states")
        if len(shape) != 3:
            raise BadSampleFile(path, "hidden_states", f"has shape {shape}, not [tokens, layers, hidden]")
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as fh:
                token_ids = _token_vector(fh.get_tensor("token_ids"), path, "token_ids")
                hidden = None if shape_only else fh.get_tensor("hidden_states")
        except (OSError, RuntimeError, ValueError) as e:
            raise BadSampleFile(path, None, f"cannot be read ({e})") from e
        input_ids = self._row(sample.sample_id, "input_ids", path)
        if not np.array_equal(token_ids, input_ids):
            raise BadSampleFile(path, "token_ids", f"holds {len(token_ids)} token ids that are not row "
                                                   f"{sample.sample_id}'s input_ids ({len(input_ids)} ids) in the dataset",
                                "The hidden states belong to another sample: regenerate the file.")
        out = RawSample(input_ids, self._row(sample.sample_id, "loss_mask", path), rows=shape[0], width=shape[1] * shape[2],
                        slot_width=shape[2])
        if hidden is not None:
            out.hidden = hidden.reshape(shape[0], shape[1] * shape[2])
        return out


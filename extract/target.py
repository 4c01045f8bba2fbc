"""The frozen target: loading it, its identity (`cache_tools.identity`), and a forward that stops after the last
captured layer.

Layer id l is the output of decoder layer l (HF's `hidden_states[l + 1]`), before the final
norm. Forward hooks on `model.model.layers[l]` keep those outputs; the hook of the deepest
layer needed raises `_StopForward`, which ends the forward there: no later layers, no final
norm, no lm_head.

The target's top-1 is stored for a few samples only (--top1-share): for those rows of a batch
the forward goes on past the deepest captured layer to the last one (`LayerCapture(top1_rows=
True)`): a pre-hook on each later layer slices its inputs (hidden states, masks, position
embeddings: every tensor with the batch as its first dimension) to those rows, so the other
rows pay nothing past the captured layers, and a batch without such a row stops where it would
without top-1.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools import identity
from dflash.cache_tools.layers import validate_target_layer_ids
from dflash.cache_tools.schema import TOP1_IDS, TOPK_IDS, TOPK_LOGPROBS
from dflash.runtime.devices import torch_dtype
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.runtime.logits import apply_post_head, post_head_steps
from dflash.runtime.safetensors_files import (
    check_weight_dir,
    refuse_drafter_as_target,
    refuse_incomplete_weights,
)
from torch import nn

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class TargetError(InputError):
    """The target model cannot be loaded or does not have the structure extraction needs."""


class _StopForward(Exception):
    """Raised by the last capture hook to end the forward early; never escapes this module."""


def load_target(
    model_dir: str | Path, *, dtype: str, device: str, attn_implementation: str | None,
    device_map: str | None,
) -> nn.Module:
    """Load a local HF causal LM for inference (no hub access)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise TargetError(Finding("extract.target-without-config", dir=str(path)))
    if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        raise TargetError(Finding("extract.target-without-weights", dir=str(path)))
    refuse_drafter_as_target(path)
    check_weight_dir(path, purpose="target")
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "local_files_only": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map:
        kwargs["device_map"] = device_map
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    except (OSError, ValueError, ImportError, KeyError) as e:
        raise TargetError(Finding("extract.target-unloadable", dir=str(path), error=str(e))) from e
    refuse_incomplete_weights(path, loading)
    if not device_map:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model


def config_layer_count(model_dir: str | Path) -> int | None:
    """The decoder layer count config.json gives (`num_hidden_layers`, in `text_config` for a
    multimodal wrapper), read without loading anything; None where it gives none (load_target
    and decoder_layers then say what is wrong)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config, dict) else None
    text = text if isinstance(text, dict) else config
    count = text.get("num_hidden_layers") if isinstance(text, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TargetError(Finding("extract.target-without-layers", architecture=type(model).__name__))
    return layers


def target_identity(model: nn.Module, model_dir: str | Path | None) -> dict[str, Any]:
    """The target's identity for the cache header (`cache_tools.identity`; its path is provenance)."""
    return identity.target_identity(model.config, model_dir, num_hidden_layers=len(decoder_layers(model)),
                                    architecture=type(model).__name__)


def _not_packed(position_ids: torch.Tensor) -> None:
    return None


@contextlib.contextmanager
def _rows_not_packed():
    """Skip transformers' packed-sequence detection during our forwards.

    Without an attention mask, transformers' mask preparation inspects `position_ids` for
    several sequences packed into one row, and the check ends in a host synchronisation
    (`bool(tensor.all())`) in every forward: the host cannot queue the next forward before
    the GPU has finished the previous one. Our rows never hold packed sequences (one sample
    per row, positions 0..L-1, which is what the model builds itself when given none), so
    the answer is known: "not packed" (None). Where transformers has no such check, nothing
    is changed."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@dataclass
class Captured:
    """One batch's captured states, each [B, L, D] on the compute device."""

    layers: list[torch.Tensor]  # in target_layer_ids order
    last_hidden: torch.Tensor | None  # last decoder layer's output (pre-norm), if requested
    # top1_rows: the last decoder layer's output (pre-norm) of just the rows asked for, [R, L, D]
    rows_last_hidden: torch.Tensor | None = None


_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device)


def _sliceable(value: Any) -> bool:
    """Whether a layer input is one `_slice_rows` handles (else: a full forward of the rows)."""
    if isinstance(value, tuple | list):
        return all(_sliceable(v) for v in value)
    return isinstance(value, _PLAIN)


def _slice_rows(value: Any, rows: torch.Tensor, batch: int, done: dict[int, Any]) -> Any:
    """`value` with every tensor of the batch as its first dimension cut to `rows`; 1-D tensors
    (cache positions) and broadcast ones (first dimension 1) as they are. `done` keeps the cut of
    each tensor for the later layers, which receive the same masks and position embeddings."""
    if isinstance(value, tuple | list):
        return type(value)(_slice_rows(v, rows, batch, done) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != batch:
        return value
    key = id(value)
    if key not in done:
        done[key] = (value, value.index_select(0, rows.to(value.device)))
    return done[key][1]


class LayerCapture:
    """Runs the target's decoder up to the deepest needed layer and returns the captures.

    `need_last`: every row to the last decoder layer (--store-last-hidden, --store-topk).
    `top1_rows`: the rows given to a call (`rows=`) go on to the last layer, the others stop at
    the deepest captured one (--top1-share)."""

    def __init__(self, model: nn.Module, target_layer_ids: list[int], *, need_last: bool, top1_rows: bool = False):
        self.model = model
        layers = decoder_layers(model)
        n = len(layers)
        self.target_layer_ids = validate_target_layer_ids(target_layer_ids, n, purpose="extract")
        self.last_layer = n - 1
        wanted = set(target_layer_ids) | ({n - 1} if need_last else set())
        self.stop_after = max(wanted)
        self.need_last = need_last
        # Rows go on past stop_after only when the last layer lies beyond it.
        self.continues = top1_rows and self.stop_after < n - 1
        self._out: dict[int, torch.Tensor] = {}
        self._rows: torch.Tensor | None = None  # the rows of the call that go on (continues)
        self._batch = 0
        self._cut: dict[int, Any] = {}
        self._unsliceable = False
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(wanted)]
        if self.continues:
            self._handles.append(layers[n - 1].register_forward_hook(self._last_hook))
            self._handles += [layers[i].register_forward_pre_hook(self._slicing_hook, with_kwargs=True)
                              for i in range(self.stop_after + 1, n)]
        self.full_forwards = 0  # calls whose layer inputs could not be sliced (a forward of the rows)

    def _hook(self, idx: int):
        def hook(_module, _inputs, output):
            self._out[idx] = output[0] if isinstance(output, tuple) else output
            if idx == self.stop_after and not self.continues:
                raise _StopForward
        return hook

    def _last_hook(self, _module, _inputs, output):
        self._out[-1] = output[0] if isinstance(output, tuple) else output
        raise _StopForward

    def _slicing_hook(self, _module, args, kwargs):
        rows = self._rows
        if rows is None or self._unsliceable:  # no row goes on (or they go on in a forward of their own)
            raise _StopForward
        if rows.shape[0] == self._batch:  # every row: nothing to cut
            return None
        if not _sliceable(args) or not _sliceable(tuple(kwargs.values())):
            self._unsliceable = True
            raise _StopForward
        return (_slice_rows(args, rows, self._batch, self._cut),
                {k: _slice_rows(v, rows, self._batch, self._cut) for k, v in kwargs.items()})

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 rows: torch.Tensor | None = None) -> Captured:
        """`rows` (int64, with `top1_rows`): the batch rows to run on to the last layer, None or
        empty for none."""
        self._out, self._cut, self._unsliceable = {}, {}, False
        self._rows = rows if self.continues and rows is not None and rows.numel() else None
        self._batch = int(input_ids.shape[0])
        self._forward(input_ids, attention_mask)
        out = self._out
        rows_last = out.get(-1)
        if self._unsliceable:  # this family's layer inputs cannot be cut by row: run the rows alone
            self.full_forwards += 1
            pick = rows.to(input_ids.device)
            self._out, self._unsliceable = {}, False
            self._rows, self._batch = torch.arange(pick.shape[0], device=pick.device), int(pick.shape[0])
            self._forward(input_ids.index_select(0, pick),
                          None if attention_mask is None else attention_mask.index_select(0, pick))
            rows_last = self._out[-1]
        self._out, self._cut, self._rows = {}, {}, None
        return Captured(
            layers=[out[i] for i in self.target_layer_ids],
            last_hidden=out[self.last_layer] if self.need_last else None,
            rows_last_hidden=rows_last,
        )

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        try:
            with _rows_not_packed():
                self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise TargetError(Finding("extract.forward-ended-early", architecture=type(self.model).__name__))


def _final_norm_and_head(model: nn.Module, flag: str) -> tuple[nn.Module, nn.Module]:
    norm = getattr(model.model, "norm", None)
    head = model.get_output_embeddings()
    if norm is None or head is None:
        raise TargetError(Finding("extract.target-without-head", flag=flag, architecture=type(model).__name__))
    return norm, head


def next_token_reducer(topk: int, top1: bool, *, scale: float | None = None,
                       softcap: float | None = None) -> Callable[[torch.Tensor], tuple]:
    """What the cache keeps of one row chunk of the head's output [C, V] (in the head's dtype):
    (top-k log-probs f32 [C, k], their ids int64 [C, k], the top-1 int64 [C]), None for what is
    not asked; `scale`, `softcap`: the target's post-head steps (runtime/logits.py), applied in
    float32 first, as the target's forward does.

    The values of `log_softmax(logits.float()).topk(k)`, with the top-k taken on the head's own
    output (bf16: its float32 copy and its log-probs have the same order, exactly, at twice the
    bytes to sort) and the log_softmax gathered at those k ids: compiled (ExtractionEngine does),
    only each row's maximum and sum of exponentials are computed, in one read of the bf16 logits
    with the argmax, and no float32 tensor of the vocabulary's width is written; eager, the
    log-probs are those of before, bit for bit. Ties are equal logits with equal log-probs; which
    of two tied ids comes first, and which one a tie at the k-th place keeps, is topk's choice,
    as it was. The top-1 is the argmax (the first of tied maxima)."""
    steps = scale is not None or softcap is not None

    def reduce(logits: torch.Tensor) -> tuple:
        z = apply_post_head(logits.float(), scale=scale, softcap=softcap) if steps else logits
        logprobs = ids = None
        if topk:
            ids = z.topk(topk, dim=-1).indices
            z32 = z.float()
            logprobs = torch.log_softmax(z32, dim=-1).gather(-1, ids)
            z = z32  # the argmax of the same values (on a CPU, faster in float32)
        return logprobs, ids, z.argmax(dim=-1) if top1 else None

    return reduce


def head_reducer(model: nn.Module, *, topk: int, top1: bool) -> Callable[[torch.Tensor], tuple]:
    """`next_token_reducer` with the target's own post-head steps."""
    return next_token_reducer(topk, top1, **post_head_steps(model.config))


@torch.inference_mode()
def next_token_outputs(model: nn.Module, last_hidden: torch.Tensor, *, topk: int = 0, top1: str | None = None,
                       chunk_tokens: int = 2048, reduce: Callable[[torch.Tensor], tuple] | None = None,
                       ) -> dict[str, torch.Tensor]:
    """What the cache stores of the target's next-token distribution, from pre-norm last hidden
    states [T, D], through the target's own final norm, lm_head and post-head steps
    (runtime/logits.py), one head pass for both:
    - `topk`: "topk_ids" (int32) and "topk_logprobs" (f32), the top-k log-probs;
    - `top1`: "top1_ids" [T, 1], the greedy next token (argmax) in the bits of that dtype
      (schema.TOP1_DTYPES: uint16 ids travel as int16 of the same bits). What greedy
      verification checks a draft against: the trainer's held-out estimate replays it.
    The head runs on `chunk_tokens` rows at a time (the logits of 32K tokens x 150K ids would
    not fit), each chunk reduced at once (`next_token_reducer`; `reduce`: the same for these
    `topk` and `top1`, compiled by the caller)."""
    norm, head = _final_norm_and_head(model, "--store-topk" if topk else "--store-top1")
    reduce = reduce or head_reducer(model, topk=topk, top1=top1 is not None)
    ids_k, lp_k, ids_1 = [], [], []
    for start in range(0, last_hidden.shape[0], chunk_tokens):
        logprobs, ids, first = reduce(head(norm(last_hidden[start:start + chunk_tokens])))
        if topk:
            ids_k.append(ids.to(torch.int32))
            lp_k.append(logprobs)
        if top1:
            ids_1.append(torch.where(first >= 1 << 15, first - (1 << 16), first).to(torch.int16)
                         if top1 == "uint16" else first.to(torch.int32))
    out = {}
    if topk:
        out[TOPK_IDS], out[TOPK_LOGPROBS] = torch.cat(ids_k), torch.cat(lp_k)
    if top1:
        out[TOP1_IDS] = torch.cat(ids_1)[:, None]
    return out

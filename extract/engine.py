"""The device side of one batch: forward, pack real tokens, encode, copy to the host.

`launch(batch, dest)` only enqueues work on a CUDA device: the forward up to the last
captured layer, a gather of the real (unpadded) tokens, fp8 quantization when the codec asks
for it, and asynchronous copies to the host on a separate stream (so they overlap the next
batch's forward), followed by an event. When the destination part buffer is page-locked
shared memory, each sample's rows are copied by DMA straight to their place in the part:
the host touches no hidden state at all. Otherwise the rows go to rotating pinned host
slots; `wait(handle)` blocks on the event and returns numpy views of them for the caller to
place (a copier thread does, while the main thread keeps launching).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from dflash.cache_tools.codecs import HiddenCodec, bf16_values
from dflash.cache_tools.sample_scores import top1_selected
from dflash.cache_tools.schema import (
    HIDDEN,
    LAST_HIDDEN,
    TOP1_IDS,
    scale_of,
)
from dflash.runtime.findings import Finding, emit
from torch import nn

from .batching import Batch
from .buffers import PartGroup
from .codecs import device_encoder, quantize_fp8
from .target import LayerCapture, head_reducer, next_token_outputs

# Diagnostic: run a lossy codec's encoder with the eager (unfused) code on the GPU too.
EAGER_FP8_ENV = "DFLASH_EXTRACT_EAGER_FP8"


def _compiled_quantizer(device: torch.device, widths: list[tuple[int, int]], quantize=quantize_fp8,
                        codec: HiddenCodec | None = None):
    """A codec's device encoder (`quantize`, of `codec`: fp8 by default) fused by torch.compile:
    in eager mode the scale search makes several passes over a float32 copy of the batch per
    candidate scale (nf4: 15 compares per candidate), a visible share of the forward on a GPU
    (docs/BENCHMARKS.md, extraction runs); fused, each candidate reads the batch once.
    Compiled here, before the loop, for every (layers, hidden) width the loop will use, with
    the token count dynamic; where compiling fails the eager code is used."""
    codec = codec if codec is not None else HiddenCodec(name="fp8")
    try:
        compiled = torch.compile(quantize, dynamic=True)
        # Under inference mode, as in launch(): compiled outside it, the first batch would
        # compile again (a guard on the grad mode) while the GPU waits.
        with torch.inference_mode():
            _probe(compiled, device, widths, quantize, codec)
    except Exception as e:  # noqa: BLE001 - any compiler failure: stay correct, run eager
        emit(Finding("extract.runs-unfused", part="quantization", error=_first_line(e)))
        return quantize
    return compiled


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _allocator_line(device: torch.device) -> str:
    """Profiling: how often the caching allocator went to the driver (each cudaFree waits for the
    whole device) and had to free its cache and retry, since the process started."""
    stats = torch.cuda.memory_stats(device)
    return (f"allocator: {stats.get('num_device_alloc', 0)} cudaMalloc, {stats.get('num_device_free', 0)} "
            f"cudaFree, {stats.get('num_alloc_retries', 0)} retries, peak "
            f"{stats.get('allocated_bytes.all.peak', 0) / 2**30:.1f} GiB of "
            f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}")


def _probe(compiled, device: torch.device, widths: list[tuple[int, int]], quantize, codec: HiddenCodec) -> None:
    """The compiled encoder's rows decode (by the codec, on the host) as close to the probe as
    the eager code's: fused arithmetic may pick another of two near-equal scales of a row or
    group (a few bytes differ), so the check is the decoded error, not the bytes."""
    for layers, hidden in widths:
        for tokens in (7, 33):  # two sizes: the token count stays symbolic
            probe = torch.randn(tokens, layers * hidden, device=device, dtype=torch.bfloat16)
            got, want = compiled(probe, layers), quantize(probe, layers)
            if any((a is None) != (b is None) or (a is not None and a.shape != b.shape) for a, b in zip(got, want)):
                raise RuntimeError(f"compiled {codec.name} encoding differs from the eager code")
            values = probe.float().cpu().numpy()
            err, ref_err = (float(np.linalg.norm(_host_decoded(codec, *rows, values.shape) - values))
                            for rows in (got, want))
            if err > ref_err * 1.01:
                raise RuntimeError(f"compiled {codec.name} encoding differs from the eager code")


def _host_decoded(codec: HiddenCodec, stored: torch.Tensor, scale: torch.Tensor | None,
                  shape: tuple[int, int]) -> np.ndarray:
    """Device-encoded rows decoded by the codec on the host, as float32 values of `shape`."""
    bits = codec.decode(stored.cpu().numpy(), None if scale is None else scale.cpu().numpy(),
                        np.empty(shape, np.uint16))
    return bf16_values(bits)


def _compiled_head(reduce, device: torch.device, vocab: int, dtype: torch.dtype):
    """The head's chunk reduction (`target.next_token_reducer`) fused by torch.compile: eager,
    the log_softmax writes a float32 copy of the chunk's logits and their log-probs over the
    whole vocabulary, and the argmax reads the logits again; fused, one kernel reads the bf16
    logits for each row's maximum, sum of exponentials and argmax, and only the k log-probs
    are written. Compiled before the loop for any row count, checked against the eager code;
    where compiling fails the eager code is used."""
    try:
        compiled = torch.compile(reduce, dynamic=True)
        with torch.inference_mode(), warnings.catch_warnings():
            # inductor splits the reduction over a long vocabulary row and says so in six lines (on
            # CUDA): a choice of its own, nothing a user of the extraction can act on
            warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled", category=UserWarning)
            # two sizes: the row count stays symbolic; and one row, which torch.compile
            # specializes (a batch's last chunk can be one row: compiled here, not mid-run)
            for rows in (7, 33, 1):
                probe = torch.randn(rows, vocab, device=device, dtype=torch.float32).mul_(4).to(dtype)
                got, want = compiled(probe), reduce(probe)
                for g, w in zip(got, want):
                    if (g is None) != (w is None) or (g is not None and (
                            g.shape != w.shape or not (torch.equal(g, w) if not g.is_floating_point()
                                                       else torch.allclose(g, w, rtol=1e-5, atol=1e-5)))):
                        raise RuntimeError("the compiled head reduction differs from the eager code")
    except Exception as e:  # noqa: BLE001 - any compiler failure: stay correct, run eager
        emit(Finding("extract.runs-unfused", part="head", error=_first_line(e)))
        return reduce
    return compiled


_NP_OF = {torch.int16: np.uint16, torch.uint8: np.uint8, torch.float32: np.float32, torch.int32: np.int32}


@dataclass
class Pending:
    batch: Batch
    slot: int
    tokens: int
    event: torch.cuda.Event | None
    direct: bool = False  # the rows were copied straight into the part buffer


class ExtractionEngine:
    # Host buffer sets in rotation: the batch being computed, the one being copied out, and
    # one spare so that launching never waits for the copy of the batch before last.
    NUM_SLOTS = 3

    def __init__(self, model: nn.Module, capture: LayerCapture, codec: HiddenCodec, *,
                 device: torch.device, topk: int, min_rows: int = 1024, top1: str | None = None,
                 top1_share: float = 1.0, store_last_hidden: bool | None = None):
        self.model = model
        self.capture = capture
        self.codec = codec
        self.device = device
        self.topk = topk
        self.top1 = top1  # the storage dtype of the target's greedy next token, None: not stored
        self.top1_share = top1_share  # stored for the samples whose split key scores below it (top1_selected)
        self.min_rows = min_rows
        # Whether the cache keeps the last hidden state (None: whenever the capture reaches the
        # last layer); without it, the last layer feeds the head alone and is neither encoded
        # nor copied.
        self.store_last_hidden = capture.need_last if store_last_hidden is None else store_last_hidden
        self.cuda = device.type == "cuda"
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(self.NUM_SLOTS)]
        self._launched = 0
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # DFLASH_PROFILE_EXTRACT=1: events around every forward, to tell GPU idle time apart.
        self._timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = (
            [] if self.cuda and os.environ.get("DFLASH_PROFILE_EXTRACT") else None)
        self._origin: torch.cuda.Event | None = None
        encoder = device_encoder(codec)
        self._quantize = encoder.encode
        if self.cuda and encoder.fused and not os.environ.get(EAGER_FP8_ENV):
            hidden = int(model.get_input_embeddings().weight.shape[1])
            widths = [(len(capture.target_layer_ids), hidden)] + ([(1, hidden)] if capture.need_last else [])
            self._quantize = _compiled_quantizer(device, widths, self._quantize, codec)
        # The head's reduction of every token's logits (--store-topk, or the top-1 of every row).
        self._reduce = head_reducer(model, topk=topk, top1=top1 is not None) if topk or top1 else None
        if self.cuda and topk:  # (probed where the head's logits are: its device under a device map)
            w = model.get_output_embeddings().weight
            self._reduce = _compiled_head(self._reduce, w.device, int(w.shape[0]), w.dtype)

    def _encode(self, h: torch.Tensor, num_layers: int, name: str) -> dict[str, torch.Tensor]:
        """The codec's stored rows (and scales, where it keeps them), on the device: a lossy
        codec's bytes, not bf16's, cross to the host."""
        rows, scale = self._quantize(h, num_layers)
        return {name: rows} if scale is None else {name: rows, scale_of(name): scale}

    def _host(self, slot: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """A host buffer of at least like's rows (grown on demand, pinned on CUDA)."""
        buf = self._slots[slot].get(name)
        rows = like.shape[0]
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != like.shape[1:]:
            rows = max(rows, self.min_rows, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, pin_memory=self.cuda)
            self._slots[slot][name] = buf
        return buf[:like.shape[0]]

    @torch.inference_mode()
    def launch(self, batch: Batch, dest: PartGroup | None = None) -> Pending:
        """Queue one batch. With `dest` (page-locked on CUDA, any buffers on the CPU) the rows
        land in their parts directly; else in a host slot that `wait` returns."""
        ids, gather = batch.input_ids, batch.gather_index
        if self.cuda:
            # From pageable memory a copy to the GPU first waits for all queued work; from
            # pinned memory it is queued like a kernel, so batch i+1 waits behind batch i.
            ids, gather = ids.pin_memory(), gather.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        gather = gather.to(self.device, non_blocking=True)
        if self._timeline is not None:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        # No attention mask: rows are right-padded and attention is causal, so a real token
        # never sees a pad. Without a padding mask the model takes its plain causal path,
        # which is faster and has no host synchronisation (mask checks) inside the forward.
        selected = self._top1_rows(batch)
        cap = self.capture(ids, None, rows=self._on_device(selected) if selected is not None and selected.size else None)
        # Only real tokens leave the device; index_select avoids the host sync of a bool mask.
        packed = torch.cat([h.reshape(-1, h.shape[-1]).index_select(0, gather.to(h.device))
                            for h in cap.layers], dim=1).to(self.device)
        out = self._encode(packed, len(cap.layers), HIDDEN)
        heads: dict[str, torch.Tensor] = {}
        last = None
        if cap.last_hidden is not None:
            last = cap.last_hidden.reshape(-1, cap.last_hidden.shape[-1])
            last = last.index_select(0, gather.to(last.device))
            if self.store_last_hidden:
                out.update(self._encode(last.to(self.device), 1, LAST_HIDDEN))
            if self.topk or (self.top1 and selected is None):  # one pass of the head for both
                heads = next_token_outputs(self.model, last, topk=self.topk, top1=self.top1, reduce=self._reduce)
        if self.top1 and selected is not None:
            heads[TOP1_IDS] = self._selected_top1(batch, selected, cap, last, heads.get(TOP1_IDS))
        out.update({name: values.to(self.device) for name, values in heads.items()})
        if self._timeline is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._timeline.append((started, ended))
        direct = dest is not None and (not self.cuda or dest.pinned_for(batch.members))
        slot = self._launched % self.NUM_SLOTS
        self._launched += 1
        event = None
        with self._on_copy_stream(out):
            if direct:
                dest.put_tensors(batch.members, out)
            else:
                for name, t in out.items():
                    self._host(slot, name, t).copy_(t, non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
        return Pending(batch, slot, batch.real_tokens, event, direct)

    def _top1_rows(self, batch: Batch) -> np.ndarray | None:
        """The batch rows whose samples get the target's top-1 (--top1-share); None: every row
        (share 1, as before the share existed) or no top-1 stored."""
        if not self.top1 or self.top1_share >= 1:
            return None
        return np.flatnonzero(top1_selected(np.asarray(batch.split_keys, np.int64), self.top1_share))

    def _on_device(self, index: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(index)
        return (t.pin_memory() if self.cuda else t).to(self.device, non_blocking=True)

    def _selected_top1(self, batch: Batch, rows: np.ndarray, cap, last: torch.Tensor | None,
                       all_top1: torch.Tensor | None) -> torch.Tensor:
        """top1_ids [T_real, 1] of the batch: the target's top-1 for the tokens of `rows`, 0 for
        the others (their samples carry none). The head runs over the tokens of `rows` only: from
        every row's last layer when the capture ran them all (`last`, or `all_top1` when the head
        already ran), else from the rows' own continued forward (`cap.rows_last_hidden`)."""
        dtype = torch.int16 if self.top1 == "uint16" else torch.int32
        top1 = torch.zeros((batch.real_tokens, 1), dtype=dtype, device=self.device)
        if not rows.size:
            return top1  # no row selected: no layer past the captured ones, no head
        gather, dest = batch.row_tokens(rows)
        dest_d = self._on_device(dest)
        if all_top1 is not None:
            values = all_top1.index_select(0, dest_d.to(all_top1.device))
        else:
            if last is not None:
                hidden = last.index_select(0, dest_d.to(last.device))
            else:
                h = cap.rows_last_hidden
                hidden = h.reshape(-1, h.shape[-1]).index_select(0, self._on_device(gather).to(h.device))
            values = next_token_outputs(self.model, hidden, top1=self.top1)[TOP1_IDS]
        return top1.index_copy_(0, dest_d, values.to(self.device))

    def mark_start(self) -> None:
        """Profiling: the moment the loop starts, for `timeline_report`."""
        if self._timeline is not None:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def timeline_report(self) -> str | None:
        """Profiling: where the GPU's time went between `mark_start` and now (synchronises)."""
        if self._timeline is None or self._origin is None or not self._timeline:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        each = sorted(a.elapsed_time(b) for a, b in self._timeline)  # ms
        busy = sum(each) / 1e3
        gaps = [self._timeline[i][1].elapsed_time(self._timeline[i + 1][0]) / 1e3
                for i in range(len(self._timeline) - 1)]
        first = self._origin.elapsed_time(self._timeline[0][0]) / 1e3
        tail = self._timeline[-1][1].elapsed_time(end) / 1e3
        total = self._origin.elapsed_time(end) / 1e3
        big = sorted(gaps, reverse=True)[:5]
        return (f"GPU timeline: {total:.2f} s, forwards {busy:.2f} s ({len(self._timeline)}, "
                f"{busy / len(self._timeline) * 1e3:.0f} ms each), before the first {first:.2f} s, "
                f"gaps between forwards {sum(gaps):.2f} s (largest {', '.join(f'{g:.3f}' for g in big)}), "
                f"after the last {tail:.2f} s; a forward's ms: median {each[len(each) // 2]:.0f}, "
                f"first {self._timeline[0][0].elapsed_time(self._timeline[0][1]):.0f}, "
                f"fastest {each[0]:.0f}, slowest {each[-1]:.0f}; {_allocator_line(self.device)}")

    @contextlib.contextmanager
    def _on_copy_stream(self, tensors: dict[str, torch.Tensor]):
        """Run the device-to-host copies on the copy stream, after the batch's kernels and
        overlapping the next batch's; the device tensors stay allocated until they are done."""
        if self._copy_stream is None:
            yield
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors.values():
            t.record_stream(self._copy_stream)
        with torch.cuda.stream(self._copy_stream):
            yield

    def wait(self, pending: Pending) -> dict[str, np.ndarray]:
        """Host rows of a launched batch (nothing for a direct one, whose rows are in place
        once this returns); valid until the launch after next reuses the slot."""
        if pending.event is not None:
            pending.event.synchronize()
        if pending.direct:
            return {}
        rows = pending.tokens
        return {
            name: buf[:rows].numpy().view(_NP_OF[buf.dtype])
            for name, buf in self._slots[pending.slot].items()
        }

"""A codec is a registration: a toy codec declared here, in the tests, writes a cache, reads it
back, names itself in the manifest and travels to the trainer's device, with no product file
edited. And the shipped codecs' host encoders store what the extraction engine's GPU encoders
store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from cache_utils import random_sample, tiny_header
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.codecs import (
    HiddenCodec,
    bf16_bits,
    bf16_values,
    codec_names,
    register_codec,
)
from dflash.cache_tools.errors import CacheError
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.extract.codecs import device_encoder
from dflash.train.data.codecs import register_device_decoder
from dflash.train.data.loader import STORED_CODEC, collate, dequantize_batch, read_batch


@register_codec
@dataclass(frozen=True, kw_only=True)
class ToyInt8Codec(HiddenCodec):
    """Symmetric int8 with one float32 scale per (token, layer), stored as uint8 (+128)."""

    name: str = "toy-int8"
    storage_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)
    has_scale: ClassVar[bool] = True
    lossless: ClassVar[bool] = False

    def encode(self, values, num_layers):
        tokens, width = values.shape
        x = values.reshape(tokens, num_layers, -1)
        scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / 127, 1e-30).astype(np.float32)
        q = (np.rint(x / scale) + 128).astype(np.uint8)
        return q.reshape(tokens, width), scale.reshape(tokens, num_layers)

    def decode(self, stored, scale, out):
        tokens, width = stored.shape
        x = (stored.astype(np.float32) - 128).reshape(tokens, scale.shape[1], -1) * scale[:, :, None]
        return bf16_bits(x.reshape(tokens, width), out)


@register_device_decoder("toy-int8")
def decode_toy_int8(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    *lead, width = rows.shape
    x = (rows.float() - 128).reshape(-1, scale.shape[-1], width // scale.shape[-1]) * scale.reshape(-1, scale.shape[-1], 1)
    return (x + 0.0).reshape(*lead, width).bfloat16()  # + 0.0: padding (zero bytes, scale 0) is +0.0


def write(path, codec: str, seed: int = 0):
    writer = CacheWriter(path, tiny_header(codec, hidden_size=32, store_last_hidden=True))
    gen = torch.Generator().manual_seed(seed)
    samples = []
    with writer.part_writer("part-000000") as pw:
        for s, n in enumerate([5, 70, 33, 1]):
            ids, mask, hidden = random_sample(gen, n, 64)
            last = torch.randn(n, 32, generator=gen).bfloat16()
            pw.add_sample(s, ids, mask, hidden, last_hidden=last)
            samples.append((hidden, last))
    return path, samples


def test_a_codec_registered_in_the_tests_writes_and_reads_a_cache(tmp_path):
    assert "toy-int8" in codec_names()
    cache, samples = write(tmp_path / "c", "toy-int8")
    manifest = read_manifest(cache)
    assert isinstance(manifest.codec, ToyInt8Codec) and manifest.header["hidden"]["codec"]["name"] == "toy-int8"
    reader = CacheReader(cache)
    assert "hidden_scale" in reader.schema and reader.schema["hidden"].dtype == np.uint8  # its declared stored form
    for i, (hidden, last) in enumerate(samples):
        got = reader.read_sample(i)
        for key, want in (("hidden", hidden), ("last_hidden", last)):
            x, y = want.float().numpy(), bf16_values(got[key])
            assert np.abs(x - y).max() <= np.abs(x).max() / 127  # within half a step of the largest scale
        stored = reader.read_sample(i, dequantize=False)
        assert stored["hidden"].dtype == np.uint8 and stored["hidden_scale"].shape == (len(hidden), 2)


def test_a_registered_device_decoder_decodes_the_batch_as_the_reader_does(tmp_path):
    caches = CacheSet([str(write(tmp_path / "c", "toy-int8")[0])], max_seq_len=1000)
    batch = read_batch(caches, [1, 0, 3])
    assert batch["hidden"].dtype == torch.uint8 and STORED_CODEC + "toy-int8" in batch  # travels stored
    got = dequantize_batch(batch)
    want = collate([caches.read(i) for i in [1, 0, 3]])
    for key in ("hidden", "last_hidden"):
        assert torch.equal(got[key].view(torch.int16), want[key].view(torch.int16))
    assert not any(k.startswith(STORED_CODEC) or k.endswith("_scale") for k in got)


def test_a_codec_name_nobody_registered_is_refused_naming_the_registered_ones():
    with pytest.raises(CacheError) as err:
        HiddenCodec.from_dict({"name": "toy-int9"})
    assert err.value.code == "cache.codec-unknown" and err.value.fields["name"] == "toy-int9"
    assert {"bf16", "fp8", "nf4", "toy-int8"} <= {name for name, _summary in err.value.fields["choices"]}
    with pytest.raises(ValueError, match="registered already"):
        register_codec(type("Other", (ToyInt8Codec,), {"__annotations__": {}}))


def test_nf4_refuses_a_width_that_is_not_a_multiple_of_its_group():
    nf4 = HiddenCodec(name="nf4")
    with pytest.raises(CacheError) as err:
        nf4.validate(48)
    assert err.value.code == "cache.codec-nf4-width" and err.value.fields == {"group": 32, "width": 48}
    assert nf4.bytes_per_token(64, 2) == 64 // 2 + 2 * 64 // 32
    assert HiddenCodec(name="fp8").bytes_per_token(64, 2) == 64 + 4 * 2  # e4m3 bytes and two scales
    assert HiddenCodec(name="bf16").bytes_per_token(64, 2) == 128


@pytest.mark.parametrize("name", ["bf16", "fp8", "nf4"])
def test_the_host_encoder_stores_what_the_extraction_engines_encoder_stores(name):
    codec = HiddenCodec(name=name)
    hidden = torch.randn(300, 2 * 64) * torch.rand(300, 1) * 10
    hidden[:, ::9] *= 40
    want = [t if t is None else t.numpy() for t in device_encoder(codec).encode(hidden, 2)]
    got = codec.encode(hidden.numpy(), 2)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            np.testing.assert_array_equal(g.view(np.uint8) if g.dtype != np.float32 else g,
                                          w.view(np.uint8) if w.dtype != np.float32 else w)


def test_identity_leaves_out_the_packing_fields():
    assert HiddenCodec(name="fp8", clevel=5, blocksize=0).identity() == {"name": "fp8"}
    assert HiddenCodec.from_dict({"name": "bf16", "zstd_hash_log": 20}).identity() == {"name": "bf16"}


def test_verify_checks_a_registered_codecs_stored_values_by_the_codec(tmp_path):
    """verify read every one-byte stored value as e4m3: the toy codec's largest code (+127,
    stored 255) was reported as "NaN or infinite" in a sound cache."""
    from dflash.cache_tools.maintenance import verify_cache

    cache, _ = write(tmp_path / "c", "toy-int8")
    report = verify_cache(cache, progress=False)
    assert report.ok and report.chunks > 0, [str(p) for p in report.problems]


def test_recompress_passes_stored_rows_through_only_between_codecs_of_one_stored_form(tmp_path):
    """recompress compared (storage dtype, scale, packed): toy-int8 rows (uint8 and a scale, as
    fp8's) were copied as they are into an fp8 cache, which read them as e4m3 bytes."""
    from dflash.cache_tools.rewrite import recompress_cache

    cache, samples = write(tmp_path / "c", "toy-int8")
    recompress_cache(cache, tmp_path / "fp8", codec="fp8", progress=False)
    reader = CacheReader(tmp_path / "fp8")
    for i, (hidden, _last) in enumerate(samples):
        x, y = hidden.float().numpy(), bf16_values(reader.read_sample(i)["hidden"])
        assert np.abs(x - y).max() <= np.abs(x).max() / 127 + np.abs(x).max() / 16  # int8 then e4m3 steps
    assert HiddenCodec(name="bf16").stored_form == HiddenCodec(name="raw").stored_form  # the same bits
    assert HiddenCodec(name="fp8").stored_form != HiddenCodec(name="toy-int8").stored_form


def test_verify_reports_an_nf4_chunk_whose_group_scale_is_not_finite_or_negative(tmp_path):
    from dflash.cache_tools.maintenance import verify_cache

    nf4 = HiddenCodec(name="nf4")
    writer = CacheWriter(tmp_path / "c", tiny_header("nf4", hidden_size=32))
    gen = torch.Generator().manual_seed(0)
    with writer.part_writer("part-000000") as pw:
        for s, bad in enumerate((None, 0xFFC0, 0x8000 | 0x3F80)):  # sound; a NaN scale; a scale of -1
            ids, mask, hidden = random_sample(gen, 20, 64)
            rows, _ = nf4.encode(hidden.float().numpy(), 2)
            if bad is not None:  # (the group scales are a row's last bytes)
                rows[5, -2:] = np.array([bad], dtype="<u2").view(np.uint8)
            pw.add_sample(s, ids, mask, rows)
    report = verify_cache(tmp_path / "c", progress=False)
    assert [(p.part, p.array) for p in report.problems] == [("part-000000", "hidden")] * 2
    assert all(p.finding.code == "cache.verify-values-not-finite" and p.finding.fields["values"] == 1
               for p in report.problems)

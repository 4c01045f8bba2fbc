"""Round trips through the cache format: every codec, every array, lengths from 1 token up."""

from __future__ import annotations

import json

import numcodecs.blosc
import numpy as np
import pytest
import torch
import zarr
from cache_utils import bits, random_sample, tiny_header
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.errors import CacheError, ConfigMismatchError
from dflash.cache_tools.manifest import check_identity, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.train.data.loader import sample_tensors

LENGTHS = [1, 2, 15, 16, 17, 63, 64, 65, 130, 1000, 3001]
NF4_BOUND = 0.15  # nf4's documented bound per (token, layer) row (docs/cache-format.md)


def write_cache(path, codec, lengths, *, per_part=4, seed=0, hidden_size=32, layers=(1, 3), **kw):
    header = tiny_header(codec, layers=layers, hidden_size=hidden_size, **kw)
    writer = CacheWriter(path, header)
    gen = torch.Generator().manual_seed(seed)
    written = []
    width = len(layers) * hidden_size
    for p in range(0, len(lengths), per_part):
        with writer.part_writer(f"part-{p // per_part:06d}") as pw:
            for i, n in enumerate(lengths[p:p + per_part]):
                ids, mask, hidden = random_sample(gen, n, width)
                extra = {}
                if header["extras"]["last_hidden"]:
                    extra["last_hidden"] = torch.randn(n, hidden_size, generator=gen).to(torch.bfloat16)
                if header["extras"]["topk"]:
                    k = header["extras"]["topk"]
                    extra["topk_ids"] = torch.randint(0, 128, (n, k), generator=gen)
                    extra["topk_logprobs"] = -torch.rand(n, k, generator=gen)
                sid = 1000 + p + i
                pw.add_sample(sid, ids, mask, hidden, **extra)
                written.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "hidden": hidden, **extra})
    return written


@pytest.mark.parametrize("codec", ["bf16", "raw"])
def test_lossless_codecs_round_trip_bit_exact(tmp_path, codec):
    written = write_cache(tmp_path / "c", codec, LENGTHS)
    reader = CacheReader(tmp_path / "c")
    assert len(reader) == len(LENGTHS)
    assert reader.lengths.tolist() == LENGTHS
    for i, ref in enumerate(written):
        got = sample_tensors(reader.read_sample(i))
        assert got["sample_id"] == ref["sample_id"]
        assert got["hidden"].dtype == torch.bfloat16
        np.testing.assert_array_equal(bits(got["hidden"]), bits(ref["hidden"]))
        assert torch.equal(got["input_ids"], ref["input_ids"])
        assert torch.equal(got["loss_mask"].long(), ref["loss_mask"])


def rel_error_per_token_layer(ref: torch.Tensor, got: torch.Tensor, layers: int) -> torch.Tensor:
    x = ref.float().reshape(ref.shape[0], layers, -1)
    y = got.float().reshape(ref.shape[0], layers, -1)
    return (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)


def test_fp8_round_trip_within_documented_error(tmp_path):
    # Realistic row widths (the bound is per (token, layer) row of D values).
    written = write_cache(tmp_path / "c", "fp8", LENGTHS[:8], hidden_size=512)
    reader = CacheReader(tmp_path / "c")
    worst = 0.0
    for i, ref in enumerate(written):
        got = sample_tensors(reader.read_sample(i))
        assert got["hidden"].dtype == torch.bfloat16
        err = rel_error_per_token_layer(ref["hidden"], got["hidden"], 2)
        worst = max(worst, float(err.max()))
        assert torch.equal(got["input_ids"], ref["input_ids"])
    assert worst <= 0.03, worst  # the documented bound (docs/cache-format.md)
    assert worst > 0.005  # it is lossy: a silent bf16 passthrough would show 0 here


def test_nf4_round_trip_within_documented_error(tmp_path):
    written = write_cache(tmp_path / "c", "nf4", LENGTHS[:8], hidden_size=512)
    reader = CacheReader(tmp_path / "c")
    worst, worst_cos = 0.0, 1.0
    for i, ref in enumerate(written):
        got = sample_tensors(reader.read_sample(i))
        assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == ref["hidden"].shape
        worst = max(worst, float(rel_error_per_token_layer(ref["hidden"], got["hidden"], 2).max()))
        cos = torch.nn.functional.cosine_similarity(ref["hidden"].float(), got["hidden"].float(), dim=1)
        worst_cos = min(worst_cos, float(cos.min()))
        assert torch.equal(got["input_ids"], ref["input_ids"])
    assert worst <= NF4_BOUND, worst
    assert worst > 0.03  # 4 bits a value: a silent passthrough (or fp8) would show far less
    assert worst_cos >= 0.99, worst_cos


def test_nf4_stores_at_most_three_tenths_of_raw_bf16(tmp_path):
    sizes = {}
    for codec in ("raw", "fp8", "nf4"):
        write_cache(tmp_path / codec, codec, [3000, 3000], hidden_size=512)
        sizes[codec] = read_manifest(tmp_path / codec).nbytes
    assert sizes["nf4"] <= 0.30 * sizes["raw"], sizes  # the bound, ids and masks included
    assert sizes["nf4"] < 0.75 * sizes["fp8"], sizes


def test_recompressing_to_and_from_nf4_decodes_and_re_encodes(tmp_path):
    from dflash.cache_tools.rewrite import recompress_cache

    written = write_cache(tmp_path / "bf16", "bf16", [40, 300], hidden_size=256)
    recompress_cache(tmp_path / "bf16", tmp_path / "nf4", codec="nf4", progress=False)
    recompress_cache(tmp_path / "nf4", tmp_path / "back", codec="bf16", progress=False)
    nf4, back = CacheReader(tmp_path / "nf4"), CacheReader(tmp_path / "back")
    for i, ref in enumerate(written):
        got = sample_tensors(nf4.read_sample(i))["hidden"]
        assert float(rel_error_per_token_layer(ref["hidden"], got, 2).max()) <= NF4_BOUND
        np.testing.assert_array_equal(bits(back.read_sample(i)["hidden"]), bits(got))  # bf16 keeps nf4's values


def test_fp8_stores_less_than_half_the_bytes_of_raw_bf16(tmp_path):
    sizes = {}
    for codec in ("raw", "bf16", "fp8"):
        write_cache(tmp_path / codec, codec, [3000, 3000], hidden_size=512)
        sizes[codec] = read_manifest(tmp_path / codec).nbytes
    assert sizes["fp8"] < 0.5 * sizes["raw"]  # one byte a value, then compressed
    assert sizes["fp8"] < 0.75 * sizes["bf16"]
    assert sizes["bf16"] < 0.8 * sizes["raw"]


@pytest.mark.parametrize("codec", ["bf16", "fp8", "nf4"])
def test_soft_label_arrays_round_trip(tmp_path, codec):
    written = write_cache(tmp_path / "c", codec, [5, 70, 200], store_last_hidden=True, topk=4,
                          hidden_size=256)
    reader = CacheReader(tmp_path / "c")
    for i, ref in enumerate(written):
        got = sample_tensors(reader.read_sample(i))
        assert torch.equal(got["topk_ids"], ref["topk_ids"])
        assert torch.equal(got["topk_logprobs"], ref["topk_logprobs"])
        if codec == "bf16":
            np.testing.assert_array_equal(bits(got["last_hidden"]), bits(ref["last_hidden"]))
        else:
            bound = {"fp8": 0.035, "nf4": NF4_BOUND}[codec]
            assert float(rel_error_per_token_layer(ref["last_hidden"], got["last_hidden"], 1).max()) <= bound


def test_token_ranges_and_truncated_reads(tmp_path):
    written = write_cache(tmp_path / "c", "bf16", [100, 50, 300], per_part=3)
    reader = CacheReader(tmp_path / "c")
    got = sample_tensors(reader.read_sample(2, max_tokens=17))
    np.testing.assert_array_equal(bits(got["hidden"]), bits(written[2]["hidden"][:17]))
    # A token range across a sample boundary inside one part.
    rng = sample_tensors(reader.read_tokens(0, 90, 160))
    ref = torch.cat([written[0]["hidden"][90:], written[1]["hidden"], written[2]["hidden"][:10]])
    np.testing.assert_array_equal(bits(rng["hidden"]), bits(ref))


def test_zarr_reads_the_parts_we_write(tmp_path):
    """The parts are plain zarr v3: any zarr reader sees the same values as our thin reader."""
    written = write_cache(tmp_path / "c", "bf16", [40, 90], per_part=2)
    group = zarr.open_group(tmp_path / "c" / "parts" / "part-000000", mode="r")
    hidden = group["hidden"][:]
    ref = torch.cat([w["hidden"] for w in written])
    np.testing.assert_array_equal(hidden.view(np.int16), bits(ref))
    assert group["offsets"][:].tolist() == [0, 40, 130]
    assert group["sample_ids"][:].tolist() == [1000, 1001]
    codecs = group["hidden"].metadata.to_dict()["codecs"][0]["configuration"]["codecs"]
    blosc = next(c for c in codecs if c["name"] == "blosc")["configuration"]
    default = HiddenCodec()
    assert (blosc["cname"], blosc["clevel"], blosc["shuffle"], blosc["blocksize"]) == (
        "zstd", default.clevel, "shuffle", default.blocksize)
    assert codecs[-1]["name"] == "crc32c"


def test_reopening_with_other_settings_refuses(tmp_path):
    write_cache(tmp_path / "c", "bf16", [10])
    with pytest.raises(ConfigMismatchError) as err:
        CacheWriter(tmp_path / "c", tiny_header("fp8"))
    assert err.value.code == "cache.settings-differ" and err.value.fields["cache"] == str(tmp_path / "c")  # renders --force
    assert ["hidden.codec.name", "'bf16'", "'fp8'"] in err.value.fields["differences"]
    assert err.value.fields["purpose"] == "extraction"  # (the writer of an extraction; an import says "import")
    with pytest.raises(ConfigMismatchError) as err:
        CacheWriter(tmp_path / "c", tiny_header("bf16", layers=(0, 2)))
    assert [d[0] for d in err.value.fields["differences"]] == ["target_layer_ids"]
    # --force starts anew: the old parts are gone.
    CacheWriter(tmp_path / "c", tiny_header("fp8"), force=True)
    assert read_manifest(tmp_path / "c").parts == []


def test_writer_refuses_a_non_empty_foreign_directory(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(CacheError) as err:
        CacheWriter(tmp_path / "c", tiny_header())
    assert err.value.code == "cache.dir-not-a-cache" and err.value.fields["cache"] == str(tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["notes.txt"]


def test_sample_validation_errors_name_the_sample(tmp_path):
    writer = CacheWriter(tmp_path / "c", tiny_header())
    with pytest.raises(CacheError) as err:
        with writer.part_writer("part-000000") as pw:
            pw.add_sample(7, [1, 2], [1, 1], torch.zeros(2, 10))
    assert err.value.code == "cache.write-width"
    assert (err.value.fields["sample"], err.value.fields["array"], err.value.fields["shape"]) == (7, "hidden", [10])
    with pytest.raises(CacheError) as err:
        with writer.part_writer("part-000000") as pw:
            pw.add_sample(8, [], [], torch.zeros(0, 64))
    assert err.value.code == "cache.write-sample-empty" and err.value.fields["sample"] == 8
    # Failed parts leave nothing behind.
    assert read_manifest(tmp_path / "c").parts == []
    assert [p.name for p in (tmp_path / "c" / "parts").iterdir()] == []


def _bf16_like(rng, n):
    return (rng.normal(size=n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


CHUNK_CASES = [  # (items, data kind): tiny (stored as is), odd leftovers, multi-block, incompressible, constant
    (1, "bf16"), (63, "bf16"), (64, "bf16"), (1000, "bf16"), (2049, "bf16"), (300_001, "bf16"),
    (600_000, "bf16"), (5000, "random"), (600_000, "random"), (5000, "zeros"),
]


def _chunk_data(items, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "bf16":
        return _bf16_like(rng, items)
    if kind == "random":
        return rng.integers(0, 1 << 16, items, dtype=np.uint16)
    return np.zeros(items, dtype=np.uint16)


@pytest.mark.parametrize("items,kind", CHUNK_CASES)
@pytest.mark.parametrize("codec", [HiddenCodec(name="bf16"), HiddenCodec(name="bf16", clevel=9, blocksize=1 << 12),
                                   HiddenCodec(name="bf16", blocksize=0), HiddenCodec(name="fp8"),
                                   HiddenCodec(name="nf4")])
def test_stored_chunks_decode_to_their_data(items, kind, codec):
    """Tiny chunks (stored as is), odd leftovers, several blocks, incompressible and constant
    data: every stored chunk decodes with c-blosc, and activation-like data shrinks. (That
    the chunks are the bytes zarr writes: tests/test_cache_shards.py.)"""
    data = _chunk_data(items, kind, seed=1)
    if codec.storage_dtype.itemsize == 1:
        data = data.view(np.uint8)
    chunk = codec.compress(data)
    assert numcodecs.blosc.decompress(chunk) == data.tobytes()
    if kind != "random" and items > 1000:
        assert len(chunk) < data.nbytes


def test_codec_settings_are_checked():
    for make, code, fields in ((lambda: HiddenCodec(name="bf8"), "cache.codec-unknown", {"name": "bf8"}),
                               (lambda: HiddenCodec(clevel=23), "cache.codec-level", {"clevel": 23}),
                               (lambda: HiddenCodec(blocksize=-1), "cache.codec-blocksize", {"blocksize": -1}),
                               (lambda: HiddenCodec.from_dict({"name": "bf16", "zstd_window": 10}),
                                "cache.codec-parameters", {"unknown": ["zstd_window"]})):
        with pytest.raises(CacheError) as err:
            make()
        assert err.value.code == code and {k: err.value.fields[k] for k in fields} == fields


def test_caches_of_earlier_codec_settings_still_open_and_resume(tmp_path):
    """A manifest of an earlier version (other zstd level and block size, the packing fields
    of the writer's own Blosc encoder) reads back, and extraction with today's settings may
    add parts to it: packing is not identity, and both kinds of chunk decode."""
    written = write_cache(tmp_path / "c", "bf16", [10, 20])
    path = tmp_path / "c" / "manifest.json"
    header = json.loads(path.read_text())
    header["hidden"]["codec"] = {"name": "bf16", "clevel": HiddenCodec().clevel + 1, "blocksize": 1 << 16,
                                 "zstd_hash_log": 6, "zstd_min_match": 7, "zstd_literals_only": True}
    path.write_text(json.dumps(header))
    assert read_manifest(tmp_path / "c").codec == HiddenCodec(clevel=HiddenCodec().clevel + 1, blocksize=1 << 16)
    writer = CacheWriter(tmp_path / "c", tiny_header("bf16"))  # no ConfigMismatchError
    gen = torch.Generator().manual_seed(5)
    ids, mask, hidden = random_sample(gen, 7, 64)
    with writer.part_writer("part-new") as pw:
        pw.add_sample(5, ids, mask, hidden)
    reader = CacheReader(tmp_path / "c")
    assert len(reader) == len(written) + 1
    np.testing.assert_array_equal(bits(reader.read_sample(len(written))["hidden"]), bits(hidden))
    np.testing.assert_array_equal(bits(reader.read_sample(0)["hidden"]), bits(written[0]["hidden"]))


def test_caches_of_other_zstd_levels_and_block_sizes_merge(tmp_path):
    from dflash.cache_tools.rewrite import merge_caches

    gen = torch.Generator().manual_seed(6)
    written = []
    for i, codec in enumerate((HiddenCodec(clevel=1), HiddenCodec(clevel=5, blocksize=1 << 16))):
        header = tiny_header("bf16")
        header["hidden"]["codec"] = codec.to_dict()
        with CacheWriter(tmp_path / f"c{i}", header).part_writer("part-000000") as pw:
            sample = random_sample(gen, 30, 64)
            pw.add_sample(i, *sample)
            written.append(sample[2])
    merge_caches(tmp_path / "merged", [tmp_path / "c0", tmp_path / "c1"])
    reader = CacheReader(tmp_path / "merged")
    assert len(reader) == 2
    for i, hidden in enumerate(written):
        np.testing.assert_array_equal(bits(reader.read_sample(i)["hidden"]), bits(hidden))


def test_whose_settings_differ_is_a_purpose_the_renderer_words(tmp_path):
    write_cache(tmp_path / "c", "bf16", [10])
    with pytest.raises(ConfigMismatchError) as err:
        check_identity(read_manifest(tmp_path / "c"), tiny_header("fp8"), purpose="import")
    assert err.value.fields["purpose"] == "import" and "other settings than this import" in str(err.value)
    with pytest.raises(ValueError):  # a purpose with no words is a bug
        check_identity(read_manifest(tmp_path / "c"), tiny_header("fp8"), purpose="this import")

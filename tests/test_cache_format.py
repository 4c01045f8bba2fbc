"""Round trips through the cache format: every codec, every array, lengths from 1 token up."""

from __future__ import annotations

import json
import struct
import sys

import numcodecs.blosc
import numpy as np
import pytest
import torch
import zarr
from cache_utils import bits, random_sample, tiny_header
from dflash.cache_tools import codecs
from dflash.cache_tools.codecs import HiddenCodec, blosc_zstd_compress, literals_only_available
from dflash.cache_tools.errors import CacheError, ConfigMismatchError
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter

LENGTHS = [1, 2, 15, 16, 17, 63, 64, 65, 130, 1000, 3001]


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
        got = reader.read_sample(i)
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
        got = reader.read_sample(i)
        assert got["hidden"].dtype == torch.bfloat16
        err = rel_error_per_token_layer(ref["hidden"], got["hidden"], 2)
        worst = max(worst, float(err.max()))
        assert torch.equal(got["input_ids"], ref["input_ids"])
    assert worst <= 0.03, worst  # the documented bound (docs/cache-format.md)
    assert worst > 0.005  # it is lossy: a silent bf16 passthrough would show 0 here


def test_fp8_stores_less_than_half_the_bytes_of_raw_bf16(tmp_path):
    sizes = {}
    for codec in ("raw", "bf16", "fp8"):
        write_cache(tmp_path / codec, codec, [3000, 3000], hidden_size=512)
        sizes[codec] = read_manifest(tmp_path / codec).nbytes
    assert sizes["fp8"] < 0.5 * sizes["raw"]  # one byte a value, then compressed
    assert sizes["fp8"] < 0.75 * sizes["bf16"]
    assert sizes["bf16"] < 0.8 * sizes["raw"]


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_soft_label_arrays_round_trip(tmp_path, codec):
    written = write_cache(tmp_path / "c", codec, [5, 70, 200], store_last_hidden=True, topk=4,
                          hidden_size=256)
    reader = CacheReader(tmp_path / "c")
    for i, ref in enumerate(written):
        got = reader.read_sample(i)
        assert torch.equal(got["topk_ids"], ref["topk_ids"])
        assert torch.equal(got["topk_logprobs"], ref["topk_logprobs"])
        if codec == "bf16":
            np.testing.assert_array_equal(bits(got["last_hidden"]), bits(ref["last_hidden"]))
        else:
            assert float(rel_error_per_token_layer(ref["last_hidden"], got["last_hidden"], 1).max()) <= 0.035


def test_token_ranges_and_truncated_reads(tmp_path):
    written = write_cache(tmp_path / "c", "bf16", [100, 50, 300], per_part=3)
    reader = CacheReader(tmp_path / "c")
    got = reader.read_sample(2, max_tokens=17)
    np.testing.assert_array_equal(bits(got["hidden"]), bits(written[2]["hidden"][:17]))
    # A token range across a sample boundary inside one part.
    rng = reader.read_tokens(0, 90, 160)
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
    assert (blosc["cname"], blosc["clevel"], blosc["shuffle"], blosc["blocksize"]) == ("zstd", 1, "shuffle", 1 << 20)
    assert codecs[-1]["name"] == "crc32c"


def test_reopening_with_other_settings_refuses(tmp_path):
    write_cache(tmp_path / "c", "bf16", [10])
    with pytest.raises(ConfigMismatchError, match=r"hidden\.codec\.name: cache has 'bf16', requested 'fp8'.*--force"):
        CacheWriter(tmp_path / "c", tiny_header("fp8"))
    with pytest.raises(ConfigMismatchError, match="target_layer_ids"):
        CacheWriter(tmp_path / "c", tiny_header("bf16", layers=(0, 2)))
    # --force starts anew: the old parts are gone.
    CacheWriter(tmp_path / "c", tiny_header("fp8"), force=True)
    assert read_manifest(tmp_path / "c").parts == []


def test_writer_refuses_a_non_empty_foreign_directory(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(CacheError, match="not empty and holds no cache manifest"):
        CacheWriter(tmp_path / "c", tiny_header())
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["notes.txt"]


def test_sample_validation_errors_name_the_sample(tmp_path):
    writer = CacheWriter(tmp_path / "c", tiny_header())
    with pytest.raises(CacheError, match="Sample 7: hidden has width 10"):
        with writer.part_writer("part-000000") as pw:
            pw.add_sample(7, [1, 2], [1, 1], torch.zeros(2, 10))
    with pytest.raises(CacheError, match="Sample 8 is empty"):
        with writer.part_writer("part-000000") as pw:
            pw.add_sample(8, [], [], torch.zeros(0, 64))
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
@pytest.mark.parametrize("blocksize", [1 << 12, 1 << 20])
def test_blosc_chunks_with_zstds_own_parameters_are_c_blosc_bytes(items, kind, blocksize):
    """The chunk writer's Blosc framing (header, block starts, streams, stored-as-is cases)
    is c-blosc's: with zstd's own level-1 parameters the bytes are identical."""
    data = _chunk_data(items, kind)
    for typesize, arr, shuffle, flag in ((2, data, True, numcodecs.blosc.SHUFFLE),
                                         (1, data.view(np.uint8), False, numcodecs.blosc.NOSHUFFLE)):
        ours = blosc_zstd_compress(arr, typesize=typesize, shuffle=shuffle, blocksize=blocksize, level=1)
        assert ours == numcodecs.blosc.compress(arr, b"zstd", 1, flag, blocksize), (typesize, len(ours))


@pytest.mark.parametrize("items,kind", CHUNK_CASES)
def test_blosc_chunks_as_the_format_packs_them_decode_with_c_blosc(items, kind):
    data = _chunk_data(items, kind, seed=1)
    for codec in (HiddenCodec(name="bf16", blocksize=1 << 14), HiddenCodec(name="bf16"),
                  HiddenCodec(name="bf16", zstd_literals_only=False)):
        chunk = codec.compress(data)
        assert numcodecs.blosc.decompress(chunk) == data.tobytes()
        assert codec.blosc().decode(chunk) == data.tobytes()
    for literals_only in (True, False):
        fp8 = HiddenCodec(name="fp8", blocksize=1 << 14, zstd_literals_only=literals_only).compress(data.view(np.uint8))
        assert numcodecs.blosc.decompress(fp8) == data.tobytes()


def _zstd_block_list(frame: bytes) -> list[tuple[str, int, int]]:
    """Each block of a zstd frame as (kind, content bytes, sequences) (RFC 8878: frame header,
    then blocks; a compressed block starts with its literals section, then the sequence count).
    Content bytes of a compressed block are its literals' (its whole content when it has no
    sequences); sequences is -1 for 128 or more, 0 for raw and RLE blocks."""
    descriptor = frame[4]
    single_segment, dict_id_size = (descriptor >> 5) & 1, (0, 1, 2, 4)[descriptor & 3]
    size_field = (single_segment, 2, 4, 8)[descriptor >> 6]
    pos = 5 + (0 if single_segment else 1) + dict_id_size + size_field
    blocks = []
    while True:
        header = int.from_bytes(frame[pos:pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        pos += 3
        if kind == 2:  # compressed: literals section, then the sequences section's count
            b = frame[pos:pos + size]
            lit_type, size_format = b[0] & 3, (b[0] >> 2) & 3
            if lit_type in (0, 1):  # raw or RLE literals
                header_len = (1, 2, 1, 3)[size_format]
                regenerated = int.from_bytes(b[:header_len], "little") >> (3 if size_format in (0, 2) else 4)
                lit_bytes = regenerated if lit_type == 0 else 1
            else:  # Huffman-coded
                header_len = (3, 3, 4, 5)[size_format]
                value = int.from_bytes(b[:header_len], "little")
                bits = (10, 10, 14, 18)[size_format]
                regenerated = (value >> 4) & ((1 << bits) - 1)
                lit_bytes = value >> (4 + bits)
            first = b[header_len + lit_bytes]
            blocks.append(("compressed", regenerated, first if first < 128 else -1))
        else:
            blocks.append(("raw" if kind == 0 else "rle", size, 0))
        pos += 1 if kind == 1 else size
        if last:
            return blocks


def _zstd_sequence_counts(frame: bytes) -> list[int]:
    """The number of sequences (matches) in each compressed block of a zstd frame."""
    return [seqs for kind, _, seqs in _zstd_block_list(frame) if kind == "compressed"]


def _blosc_streams(chunk: bytes) -> list[bytes]:
    """The zstd frames of a Blosc chunk's blocks (stored-as-is blocks left out)."""
    nbytes, blocksize, _ = struct.unpack_from("<iii", chunk, 4)
    if chunk[2] & 0x2:  # the whole chunk stored as is
        return []
    nblocks = -(-nbytes // blocksize)
    frames = []
    for b, start in enumerate(struct.unpack_from(f"<{nblocks}i", chunk, 16)):
        (size,) = struct.unpack_from("<i", chunk, start)
        if size != min(blocksize, nbytes - b * blocksize):
            frames.append(chunk[start + 4: start + 4 + size])
    return frames


def test_literals_only_chunks_hold_no_zstd_matches():
    """The packing that makes chunks fast to decode: every zstd block of a bf16 chunk is
    literals only, where zstd's own level 1 (and the match limits) leave matches in the
    exponent bytes. Available wherever numcodecs' zstd exports ZSTD_compressSequences, which
    the Linux wheels do."""
    if not literals_only_available():
        assert not sys.platform.startswith("linux"), "numcodecs' zstd should allow literal-only frames on Linux"
        pytest.skip("this numcodecs build does not export ZSTD_compressSequences")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 2048, generator=gen) * torch.linspace(0.1, 3.0, 2048)
    hidden[:, ::97] *= 50.0
    data = bits(hidden.to(torch.bfloat16)).view(np.uint16)
    counts = {}
    for name, codec in (("literals", HiddenCodec(name="bf16")),
                        ("limits", HiddenCodec(name="bf16", zstd_literals_only=False)),
                        ("own", HiddenCodec(name="bf16", zstd_literals_only=False, zstd_hash_log=0, zstd_min_match=0))):
        chunk = codec.compress(data)
        assert numcodecs.blosc.decompress(chunk) == data.tobytes()
        frames = _blosc_streams(chunk)
        assert frames, name
        counts[name] = [c for f in frames for c in _zstd_sequence_counts(f)]
    assert counts["literals"] and all(c == 0 for c in counts["literals"])
    assert any(c != 0 for c in counts["own"])  # the parser sees matches where there are some


@pytest.mark.parametrize("rows", [64, 80, 130])
def test_literal_frames_keep_exponent_and_mantissa_bytes_in_separate_zstd_blocks(rows):
    """A byte-shuffled block is two streams (low bytes, then high bytes). zstd cuts its frame
    into 128 KiB blocks; where the streams are not a multiple of that long (a 128 KiB Blosc
    block, a chunk's last block) a zstd block would hold both and Huffman-code the near-random
    low bytes with the exponents. The literal packing cuts at the stream boundary instead,
    which keeps the ratio of small and odd-sized blocks at that of whole 1 MiB blocks."""
    if not literals_only_available():
        assert not sys.platform.startswith("linux"), "numcodecs' zstd should allow literal-only frames on Linux"
        pytest.skip("this numcodecs build does not export ZSTD_compressSequences")
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, 1024, generator=gen) * torch.linspace(0.1, 3.0, 1024)
    data = bits(hidden.to(torch.bfloat16)).view(np.uint16)  # 128 KiB per 64 rows
    sizes = {}
    for blocksize in (1 << 17, 1 << 20):
        chunk = HiddenCodec(name="bf16", blocksize=blocksize).compress(data)
        assert numcodecs.blosc.decompress(chunk) == data.tobytes()
        sizes[blocksize] = len(chunk)
        nbytes, bsize, _ = struct.unpack_from("<iii", chunk, 4)
        frames = _blosc_streams(chunk)
        assert len(frames) == -(-nbytes // bsize)  # every block is a zstd frame
        for b, frame in enumerate(frames):
            half = min(bsize, nbytes - b * bsize) // 2
            ends = np.cumsum([content for _, content, _ in _zstd_block_list(frame)]).tolist()
            assert half in ends, (blocksize, b, ends)  # a block ends where the high bytes start
            assert ends[-1] == 2 * half
    assert sizes[1 << 17] <= sizes[1 << 20] * 1.01


def test_without_the_literal_encoder_chunks_fall_back_to_match_limits(monkeypatch):
    data = _chunk_data(300_001, "bf16", seed=2)
    with_limits = HiddenCodec(name="bf16", zstd_literals_only=False).compress(data)
    monkeypatch.setattr(codecs._LiteralsEncoder, "get", classmethod(lambda cls: None))
    chunk = HiddenCodec(name="bf16").compress(data)
    assert chunk == with_limits
    assert numcodecs.blosc.decompress(chunk) == data.tobytes()


def test_match_limits_keep_the_ratio_on_activations():
    """The format's zstd match limits store bf16 activations at least as small as zstd's own
    level-1 parameters (within 1 %), and literal-only frames within 3 %: the trade
    docs/cache-format.md describes."""
    gen = torch.Generator().manual_seed(0)
    _, _, hidden = random_sample(gen, 1024, 512)
    data = bits(hidden).view(np.uint16)
    literals = len(HiddenCodec(name="bf16").compress(data))
    limited = len(HiddenCodec(name="bf16", zstd_literals_only=False).compress(data))
    own = len(HiddenCodec(name="bf16", zstd_literals_only=False, zstd_hash_log=0, zstd_min_match=0).compress(data))
    assert data.nbytes / limited > 1.3  # it compresses at all
    assert limited <= own * 1.01
    assert literals <= own * 1.03


def test_caches_packed_with_zstds_own_parameters_still_open_and_resume(tmp_path):
    """A manifest written before the codec recorded its zstd parameters (packed with the
    level's own) reads back, and extraction may add parts to it: the packing is not identity."""
    written = write_cache(tmp_path / "c", "bf16", [10, 20])
    path = tmp_path / "c" / "manifest.json"
    header = json.loads(path.read_text())
    for key in ("zstd_hash_log", "zstd_min_match", "zstd_literals_only"):
        del header["hidden"]["codec"][key]
    path.write_text(json.dumps(header))
    assert read_manifest(tmp_path / "c").codec == HiddenCodec(name="bf16", zstd_hash_log=0, zstd_min_match=0,
                                                              zstd_literals_only=False)
    writer = CacheWriter(tmp_path / "c", tiny_header("bf16"))  # no ConfigMismatchError
    gen = torch.Generator().manual_seed(5)
    ids, mask, hidden = random_sample(gen, 7, 64)
    with writer.part_writer("part-new") as pw:
        pw.add_sample(5, ids, mask, hidden)
    reader = CacheReader(tmp_path / "c")
    assert len(reader) == len(written) + 1
    np.testing.assert_array_equal(bits(reader.read_sample(len(written))["hidden"]), bits(hidden))
    np.testing.assert_array_equal(bits(reader.read_sample(0)["hidden"]), bits(written[0]["hidden"]))

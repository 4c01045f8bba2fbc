"""Part buffers: rows of length-sorted batches land at their samples' places in the part."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from dflash.cache_tools.schema import PartSchema
from dflash.extract.buffers import PartBuffer, PartGroup, part_layout
from dflash.extract.data import PartPlan, Sample
from dflash.train.data.loader import sample_tensors


@pytest.mark.parametrize("threads", [0, 3])
def test_batches_in_any_order_fill_the_part_in_sample_order(threads):
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9, 3, 7]
    plan = PartPlan(index=0)
    for i, n in enumerate(lengths):
        plan.add(Sample(sample_id=i, input_ids=np.zeros(n, np.int64), loss_mask=np.ones(n, np.uint8)))
    fields = PartSchema(hidden_size=3, num_layers=2, storage_dtype="uint8",
                         has_scale=True, last_hidden=False, topk=0).from_target()
    full = {"hidden": rng.integers(0, 255, (sum(lengths), 6), dtype=np.uint8),
            "hidden_scale": rng.random((sum(lengths), 2), dtype=np.float32)}
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    buf = PartBuffer(plan, fields)
    copiers = ThreadPoolExecutor(threads) if threads else None
    for members in ([2, 0], [4, 3, 1]):  # length-sorted batches, not in sample order
        rows = {k: np.concatenate([v[offsets[i]:offsets[i + 1]] for i in members]) for k, v in full.items()}
        PartGroup.of(buf).put(members, rows, copiers)
        buf.mark_filled(len(members))
    assert buf.complete
    for key, ref in full.items():
        np.testing.assert_array_equal(buf.arrays[key], ref)


def _plan(lengths: list[int], index: int = 0) -> PartPlan:
    plan = PartPlan(index=index)
    for i, n in enumerate(lengths):
        plan.add(Sample(sample_id=100 * index + i, input_ids=np.zeros(n, np.int64),
                        loss_mask=np.ones(n, np.uint8)))
    return plan


def test_tensor_rows_land_in_sample_order_and_bf16_bits_survive():
    """put_tensors (the path the device copies take): uint16 bf16 bits go through int16."""
    lengths = [4, 2, 6]
    fields = PartSchema(hidden_size=4, num_layers=2, storage_dtype="uint16",
                         has_scale=False, last_hidden=True, topk=2).from_target()
    buf = PartBuffer(_plan(lengths), fields)
    g = torch.Generator().manual_seed(0)
    full = {"hidden": torch.randn(12, 8, generator=g).to(torch.bfloat16).view(torch.int16),
            "last_hidden": torch.randn(12, 4, generator=g).to(torch.bfloat16).view(torch.int16),
            "topk_ids": torch.randint(0, 1000, (12, 2), generator=g, dtype=torch.int32),
            "topk_logprobs": -torch.rand(12, 2, generator=g)}
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for members in ([2], [0, 1]):
        rows = {k: torch.cat([v[offsets[i]:offsets[i + 1]] for i in members]) for k, v in full.items()}
        PartGroup.of(buf).put_tensors(members, rows)
    for key, ref in full.items():
        got = buf.arrays[key]
        np.testing.assert_array_equal(got.view(np.int16) if got.dtype == np.uint16 else got, ref.numpy())
    assert buf.arrays["hidden"].dtype == np.uint16


class FakePinner:
    """Records registrations (the real one needs CUDA)."""

    def __init__(self):
        self.pinned: set[str] = set()
        self.registered = self.unregistered = 0

    def register(self, shm):
        self.pinned.add(shm.name)
        self.registered += 1
        return True

    def is_pinned(self, shm):
        return shm.name in self.pinned

    def unregister(self, shm):
        self.pinned.discard(shm.name)
        self.unregistered += 1


def test_pool_cycles_parts_through_its_pinned_segments_and_unpins_them(tmp_path):
    """Segments are page-locked once, before the loop; parts reuse them; a part larger than
    a segment gets a plain one (not pinned: its rows take the host-copy path); all are
    unpinned at close; every part's rows reach the cache."""
    from dflash.cache_tools.codecs import HiddenCodec
    from dflash.cache_tools.manifest import make_header
    from dflash.cache_tools.reader import CacheReader
    from dflash.cache_tools.writer import CacheWriter
    from dflash.extract.writers import WriterPool

    header = make_header(target={"path": "t", "architecture": "X", "hidden_size": 4,
                                 "num_hidden_layers": 2, "vocab_size": 10},
                         target_layer_ids=[0, 1], hidden_size=4, codec=HiddenCodec(name="raw"),
                         data={"name": "t"})
    cache = CacheWriter(tmp_path / "cache", header)
    fields = PartSchema(hidden_size=4, num_layers=2, storage_dtype="uint16",
                         has_scale=False, last_hidden=False, topk=0).from_target()
    pinner = FakePinner()
    pool = WriterPool(cache, fields, 1, pinner=pinner, segment_tokens=16, pinned_segments=2)
    assert pinner.registered == 2  # up front, before any part
    pinned_names = set(pinner.pinned)
    try:
        for p in range(6):
            big = p == 4
            plan = _plan([40, 2] if big else [3, 5], index=p)  # part 4 outgrows the segments
            buf = pool.new_buffer(plan)
            assert buf.pinned is (not big)
            assert (buf.shm.name in pinned_names) is (not big)
            buf.arrays["hidden"][...] = p
            buf.mark_filled(2)
            pool.submit(buf)
        pool.drain()
        assert pinner.registered == 2  # never again inside the loop
        pool.close()
    finally:
        pool.kill()
    assert pinner.pinned == set() and pinner.unregistered == 2
    reader = CacheReader(tmp_path / "cache")
    assert len(reader) == 12
    for i in range(12):
        sample = sample_tensors(reader.read_sample(i))
        part = sample["sample_id"] // 100
        assert (sample["hidden"].view(torch.int16) == part).all(), f"sample {i} has another part's rows"


def _tiny_cache(tmp_path):
    from dflash.cache_tools.codecs import HiddenCodec
    from dflash.cache_tools.manifest import make_header
    from dflash.cache_tools.writer import CacheWriter

    header = make_header(target={"path": "t", "architecture": "X", "hidden_size": 4,
                                 "num_hidden_layers": 2, "vocab_size": 10},
                         target_layer_ids=[0, 1], hidden_size=4, codec=HiddenCodec(name="raw"),
                         data={"name": "t"})
    fields = PartSchema(hidden_size=4, num_layers=2, storage_dtype="uint16",
                         has_scale=False, last_hidden=False, topk=0).from_target()
    return CacheWriter(tmp_path / "cache", header), fields


def test_too_little_shared_memory_is_one_clear_error_before_anything_starts(tmp_path, monkeypatch):
    """A tmpfs filled past its size kills the process with SIGBUS: refuse up front instead."""
    from dflash.extract import writers

    cache, fields = _tiny_cache(tmp_path)
    part = part_layout(fields, 1000)[1]  # bytes of one 1000-token part buffer
    monkeypatch.setattr(writers, "shm_free_bytes", lambda: 2 * part)  # 90 % of it: one buffer
    with pytest.raises(writers.WriteError) as err:
        writers.WriterPool(cache, fields, 4, segment_tokens=1000, open_parts=2)
    assert err.value.code == "extract.shared-memory-short"
    assert err.value.fields["dir"] == "/dev/shm" and err.value.fields["buffers"] == 3
    assert (err.value.fields["part_bytes"], err.value.fields["part_tokens"]) == (part, 1000)  # renders the fixes


def test_short_shared_memory_bounds_buffers_and_pinned_segments(tmp_path, monkeypatch):
    from dflash.extract import writers

    cache, fields = _tiny_cache(tmp_path)
    part = part_layout(fields, 1000)[1]
    monkeypatch.setattr(writers, "shm_free_bytes", lambda: int(5.5 * part / 0.9))  # room for 5 buffers
    pinner = FakePinner()
    pool = writers.WriterPool(cache, fields, 8, pinner=pinner, segment_tokens=1000, pinned_segments=9,
                              open_parts=2)
    try:
        assert pool.max_buffers == 3  # 5 fit, 2 are filled at once: 3 for the writers, not 9
        assert pinner.registered == 5  # not the 9 asked for
    finally:
        pool.close()
    assert pinner.unregistered == 5


def test_writers_have_started_when_the_pool_is_built(tmp_path):
    """Writer start-up (imports, cache open) happens before the loop, not while the GPU waits."""
    from dflash.extract import writers

    cache, fields = _tiny_cache(tmp_path)
    pool = writers.WriterPool(cache, fields, 2, segment_tokens=16)
    try:
        assert pool._ready == 2
        assert all(p.is_alive() for p in pool._procs)
    finally:
        pool.close()


def test_idle_writers_stay_until_the_main_process_goes(tmp_path):
    """Writers idle longer than their poll interval still take parts (they check that the
    main process lives, not who their parent is: they are children of a fork server)."""
    from dflash.cache_tools.reader import CacheReader
    from dflash.extract import writers

    cache, fields = _tiny_cache(tmp_path)
    pool = writers.WriterPool(cache, fields, 2, segment_tokens=16)
    try:
        time.sleep(1.5)  # past a writer's first 1 s wait for a task and its check of the main process
        assert all(p.is_alive() for p in pool._procs)
        buf = pool.new_buffer(_plan([3, 5], index=0))
        buf.arrays["hidden"][...] = 7
        buf.mark_filled(2)
        pool.submit(buf)
        pool.drain()
        pool.close()
    finally:
        pool.kill()
    assert len(CacheReader(tmp_path / "cache")) == 2


def test_a_writer_that_cannot_open_the_cache_fails_the_pool_at_once(tmp_path):
    from dflash.extract import writers

    cache, fields = _tiny_cache(tmp_path)
    other = dict(cache.header, target_layer_ids=[0])  # the writers open the cache with another header
    cache.header = other
    from dflash.cache_tools.errors import ConfigMismatchError

    with pytest.raises(ConfigMismatchError) as err:
        writers.WriterPool(cache, fields, 2, segment_tokens=16)
    assert err.value.code == "cache.settings-differ"
    assert err.value.fields["differences"] == [["target_layer_ids", "[0, 1]", "[0]"]]

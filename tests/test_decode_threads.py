"""A reader decodes the whole chunks of a read on threads of its process where it is given them
(set_decode_threads; a loader worker takes its share of the process's cores): the same bytes as one
thread, the same finding for a damaged chunk, and threads made again in a forked worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_utils import bits, make_cache, shard_file
from dflash.cache_tools import part_files
from dflash.cache_tools.errors import CacheCorruptError
from dflash.cache_tools.reader import CacheReader
from dflash.train.data.workers import DECODE_THREADS_CAP, decode_threads


@pytest.fixture
def threads():
    yield part_files.set_decode_threads
    part_files.set_decode_threads(1)


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_a_read_on_decode_threads_gets_the_bytes_one_thread_gets(tmp_path, threads, codec):
    cache = tmp_path / "c"
    samples = make_cache(cache, codec, parts=1, length=100)  # 16-row chunks: a sample spans 7 of them
    rows = torch.cat([samples[0][2], samples[1][2]])
    threads(3)
    assert part_files._DECODE.pool() is not None
    reader = CacheReader(cache)
    for a, b in [(0, 200), (16, 112), (3, 150)]:  # whole chunks, and chunks that straddle the range
        got = reader.read_tokens(0, a, b)
        threads(1)
        one = CacheReader(cache).read_tokens(0, a, b)
        threads(3)
        for name in got:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(one[name]))
        if codec == "bf16":
            np.testing.assert_array_equal(bits(got["hidden"]), bits(rows[a:b]))


def test_a_damaged_chunk_read_on_decode_threads_is_named_as_on_one(tmp_path, threads):
    cache = tmp_path / "c"
    make_cache(cache, "bf16", parts=1, length=100)
    path = shard_file(cache, "part-000000")
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the first chunk
    path.write_bytes(bytes(data))
    found = []
    for count in (1, 4):
        threads(count)
        with pytest.raises(CacheCorruptError) as err:
            CacheReader(cache).read_tokens(0, 0, 200)
        found.append((err.value.code, err.value.fields["part"], err.value.fields["chunk"]))
    assert found == [("cache.chunk-checksum", "part-000000", 0)] * 2


def test_forked_workers_decode_on_threads_of_their_own(tmp_path, threads):
    cache = tmp_path / "c"
    samples = make_cache(cache, "bf16", parts=2, length=100)
    threads(2)
    reader = CacheReader(cache)
    reader.read_sample(0)  # the parent's pool exists before the fork

    def read(i):
        return reader.read_sample(i)["hidden"], part_files._DECODE._pid

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=None, num_workers=2, collate_fn=read,
                                         multiprocessing_context="fork", timeout=120)
    got = list(loader)
    for i, (hidden, pid) in enumerate(got):
        np.testing.assert_array_equal(bits(hidden), bits(samples[i][2]))
        assert pid not in (None, part_files._DECODE._pid)  # the worker made its own threads


def test_a_worker_decodes_on_its_share_of_the_cores():
    assert decode_threads(workers=4, cores=16) == 3  # 15 cores beside the trainer's, over 4 workers
    assert decode_threads(workers=1, cores=2) == 1  # this host's: one worker, one thread
    assert decode_threads(workers=2, cores=64) == DECODE_THREADS_CAP
    assert decode_threads(workers=8, cores=4) == 1


def test_the_trainers_workers_decode_on_their_share_of_the_cores(tmp_path, threads, monkeypatch):
    from dflash.cache_tools.cache_set import CacheSet
    from dflash.train.config import DataConfig
    from dflash.train.data import loader

    cache = tmp_path / "c"
    make_cache(cache, "bf16", parts=1)
    monkeypatch.setattr(loader, "process_cores", lambda: 16)  # a GPU host's share: 15 cores beside the trainer
    # each batch says what its worker decodes on
    monkeypatch.setattr(loader, "read_batch", lambda caches, indices: {"threads": torch.tensor(part_files._DECODE.count)})
    batches = loader.data_loader(CacheSet([str(cache)], max_seq_len=128), [np.array([0]), np.array([1])],
                                 DataConfig(cache=[str(cache)], num_workers=2, prefetch_factor=1))
    assert [int(b["threads"]) for b in batches] == [decode_threads(2, 16)] * 2 == [DECODE_THREADS_CAP] * 2
    assert part_files._DECODE.count == 1  # the trainer's own process reads on its one thread

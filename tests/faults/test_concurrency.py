"""A cache read by DataLoader workers while another process appends parts: the readers see the
snapshot of the manifest they opened (every sample readable, values exact), and a reopen sees
the new parts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import make_header, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.train.data.loader import sample_tensors

from .helpers import wait_until

WIDTH = 2 * 32


def header() -> dict:
    return make_header(target={"path": "t", "architecture": "Qwen3ForCausalLM", "hidden_size": 32,
                               "num_hidden_layers": 4, "vocab_size": 64},
                       target_layer_ids=[1, 2], hidden_size=32, codec=HiddenCodec(name="bf16"),
                       chunk_rows=16, shard_rows=64)


def part_samples(p: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(sample_id, ids, mask, hidden) of part p: a pure function of p."""
    gen = torch.Generator().manual_seed(p)
    out = []
    for s in range(4):
        n = int(torch.randint(5, 40, (1,), generator=gen))
        out.append((p * 10 + s, torch.randint(0, 64, (n,), generator=gen), torch.randint(0, 2, (n,), generator=gen),
                    torch.randn(n, WIDTH, generator=gen).to(torch.bfloat16)))
    return out


def write_parts(cache, parts) -> None:
    writer = CacheWriter(cache, header())
    for p in parts:
        with writer.part_writer(f"part-{p:06d}") as pw:
            for sid, ids, mask, hidden in part_samples(p):
                pw.add_sample(sid, ids, mask, hidden)


APPENDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from faults.test_concurrency import write_parts
    for p in range(int(sys.argv[3]), int(sys.argv[4])):
        write_parts(sys.argv[1], [p])
        time.sleep(0.05)
""")


class Samples(torch.utils.data.Dataset):
    def __init__(self, reader: CacheReader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int):
        s = sample_tensors(self.reader.read_sample(i))
        return s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"].view(torch.int16)


def check_all(reader: CacheReader, workers: int) -> int:
    loader = torch.utils.data.DataLoader(Samples(reader), batch_size=None, num_workers=workers,
                                         multiprocessing_context="fork" if workers else None)
    seen = []
    for sid, ids, mask, hidden in loader:
        p, s = divmod(int(sid), 10)
        want_sid, want_ids, want_mask, want_hidden = part_samples(p)[s]
        assert want_sid == sid
        assert torch.equal(ids, want_ids) and torch.equal(mask.to(torch.int64), want_mask)
        np.testing.assert_array_equal(hidden.numpy(), want_hidden.view(torch.int16).numpy())
        seen.append(int(sid))
    assert len(seen) == len(set(seen)) == len(reader)
    return len(seen)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores, on purpose
def test_readers_see_a_consistent_snapshot_while_another_process_appends(tmp_path):
    cache = tmp_path / "cache"
    write_parts(cache, range(6))
    tests_dir = str(Path(__file__).parents[1])
    appender = subprocess.Popen([sys.executable, "-c", APPENDER, str(cache), tests_dir, "6", "30"])
    try:
        wait_until(lambda: len(read_manifest(cache).parts) > 6, what="the appender's first commit")
        reader = CacheReader(cache)  # a snapshot taken while parts are being appended
        snapshot = len(reader)
        assert snapshot >= 6 * 4
        passes_while_appending = 0
        while appender.poll() is None and passes_while_appending < 4:
            assert check_all(reader, workers=3) == snapshot  # the snapshot, whole and exact
            passes_while_appending += 1
        assert passes_while_appending >= 1
        assert len(read_manifest(cache).parts) > snapshot // 4  # parts were appended meanwhile
    finally:
        assert appender.wait(timeout=120) == 0
    assert len(reader) == snapshot  # an open reader keeps its snapshot
    reopened = CacheReader(cache)
    assert len(reopened) == 30 * 4  # a reopen sees every new part
    assert check_all(reopened, workers=2) == 30 * 4

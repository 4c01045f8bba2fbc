"""bench/bench_loader.py: one worker's reads of a shape's samples at each decode-thread count and
codec, each row's figures from the same sample size (the rates themselves are the host's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_loader  # noqa: E402
import bench_train  # noqa: E402


def test_each_thread_count_and_codec_gets_a_row_whose_figures_agree(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench_loader.main(["--shape", "small-long", "--samples", "2", "--threads", "1,2", "--codecs", "bf16,fp8",
                       "--repeats", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["codec"], r["threads"]) for r in rows] == [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)]
    shape = bench_train.SHAPES["small-long"]
    states = shape.seq_len * len(bench_train.LAYER_IDS[shape.target_layers]) * shape.hidden * 2
    for r in rows:
        seconds = r["ms_per_sample"] / 1e3
        assert abs(r["decoded_gb_per_s"] - states / seconds / 1e9) < 1e-9 * r["decoded_gb_per_s"] + 1e-12
        assert abs(r["context_tokens_per_s"] - shape.seq_len / seconds) < 1e-6 * r["context_tokens_per_s"]
    assert "codec  threads" in capsys.readouterr().out
    from dflash.cache_tools import part_files

    assert part_files._DECODE.count == 1  # the process reads on one thread again after the bench

"""The 27B benchmark shapes and the GPU-hours table built from the benchmarks' figures (the figures
themselves are measured on a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_hours  # noqa: E402


def test_the_hybrid_27b_target_is_qwen36_27b_and_the_27b_drafter_bench_matches_it():
    import torch
    from bench_extract import SHAPES, build_config
    from bench_train import LAYER_IDS, TARGET_27B
    from dflash.cache_tools.layers import default_target_layer_ids
    from dflash.train.model.drafter_config import DrafterConfig
    from transformers import AutoModelForCausalLM

    architecture, dims, _ = SHAPES["27b-hybrid"]
    cfg = build_config(architecture, dims)
    with torch.device("meta"):  # no memory, no init: the structure only
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    kinds = [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
             for layer in model.model.layers]
    assert kinds == (["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"]) * 16  # full attention at 3, 7, ..., 63
    assert model.model.layers[0].linear_attn.num_v_heads == 48 and model.model.layers[0].linear_attn.num_k_heads == 16
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(26.9e9, rel=0.01)  # Qwen3.6-27B's text model
    layer_ids = default_target_layer_ids(64, 5)
    assert LAYER_IDS[64] == layer_ids
    # The trainer derives the drafter of that target with the dimensions bench_train's 27b shape trains.
    drafter = DrafterConfig.from_target_config(cfg, target_layer_ids=layer_ids)
    assert (drafter.hidden_size, drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim,
            drafter.intermediate_size, drafter.vocab_size, drafter.num_target_layers) == (
        TARGET_27B.hidden, TARGET_27B.heads, TARGET_27B.kv_heads, TARGET_27B.head_dim, TARGET_27B.intermediate,
        TARGET_27B.vocab, TARGET_27B.target_layers)


def test_gpu_hours_per_billion_tokens_follow_the_measured_rates():
    extract = {"shape": "27b-hybrid", "prefill_tokens_per_second": 1.0,
               "extract": {"bf16": {"tokens_per_second": 10_000.0}, "fp8": {"tokens_per_second": 20_000.0}}}
    train = {"context_tokens_per_second": 100_000.0, "processes": 2}
    bf16, fp8 = gpu_hours.gpu_hours(extract, train)
    # By hand: 1e9 / 1e4 s = 27.78 h on one GPU; 6 epochs of 1e9 at 1e5/s on 2 GPUs = 2 x 16.67 h;
    # online 8 GPUs x 6 x 1e9 / 14,500 s = 919.54 GPU-h.
    assert bf16.extract_gpu_hours == pytest.approx(27.7778, abs=1e-3)
    assert fp8.extract_gpu_hours == pytest.approx(13.8889, abs=1e-3)
    assert bf16.train_gpu_hours == fp8.train_gpu_hours == pytest.approx(33.3333, abs=1e-3)
    assert bf16.online_gpu_hours == pytest.approx(919.540, abs=1e-2)
    assert bf16.ratio == pytest.approx(919.540 / 61.1111, rel=1e-4)
    assert "| 27b-hybrid, fp8 | 20,000 | 13.9 | 100,000 | 33.3 | 47.2 | 919.5 | 19.47x |" in \
        gpu_hours.format_table([bf16, fp8], 6)


def test_the_figures_are_read_from_a_bench_s_captured_output(tmp_path):
    figures = {"shape": "Qwen3.6-27B drafter", "context_tokens_per_second": 12_345.0, "processes": 1}
    log = tmp_path / "train.log"
    log.write_text("target + cache ready in 3.0 s\n{not json, a progress line\n"
                   + json.dumps({"kind": "earlier"}) + "\n" + json.dumps(figures, indent=1) + "\ntrailing line\n")
    assert gpu_hours.read_figures(log) == figures
    assert gpu_hours.kind(figures) == "train"
    empty = tmp_path / "empty.log"
    empty.write_text("no figures here\n")
    with pytest.raises(SystemExit, match="no JSON object"):
        gpu_hours.read_figures(empty)


def test_the_extraction_check_passes_a_real_cache_and_catches_a_row_out_of_place(tmp_path, monkeypatch):
    import bench_extract
    import torch
    from dflash.cache_tools.reader import CacheReader
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extraction

    torch.manual_seed(0)
    architecture, _, small = bench_extract.SHAPES["8b"]
    model = bench_extract.build_model(bench_extract.build_config(architecture, {**small, "num_hidden_layers": 4}),
                                      torch.device("cpu"))
    data = tmp_path / "data.jsonl"
    bench_extract.write_data(data, tokens=2048, seq_len=96, vocab=small["vocab_size"])
    cache = tmp_path / "cache"
    layers = [1, 2]
    run_extraction(ExtractConfig(target_model="tiny", data=str(data), output=str(cache), codec="bf16",
                                 target_layer_ids=layers, token_budget=512, device="cpu", progress=False),
                   model=model)
    errors, floor = bench_extract.check_cache(cache, model, layers, 3, torch.device("cpu"))
    assert len(errors) == len(floor) == 2 and max(errors) < 0.03
    assert bench_extract.check_passes(errors, floor, 0.03)

    read = CacheReader.read_sample

    def shifted(self, index):  # the states of each sample one position late: a gather off by a row
        sample = read(self, index)
        sample["hidden"] = np.roll(sample["hidden"], 1, axis=0)
        return sample

    monkeypatch.setattr(CacheReader, "read_sample", shifted)
    errors, floor = bench_extract.check_cache(cache, model, layers, 3, torch.device("cpu"))
    assert min(errors) > 0.3
    assert not bench_extract.check_passes(errors, floor, 0.03)
    # Rounding that the batched forward itself shows passes; the same error without it does not.
    assert bench_extract.check_passes([0.004, 0.05], [0.003, 0.045], 0.03)
    assert not bench_extract.check_passes([0.004, 0.05], [0.0, 0.0], 0.03)


def test_scale_bench_kills_a_rank_and_the_resumed_cache_is_the_shared_run_s(tmp_path):
    import subprocess

    out = tmp_path / "scale.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_scale.py"
    proc = subprocess.run([sys.executable, str(bench), "--gpus", "2", "--small", "--tokens-per-gpu", "3072",
                           "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    killed = figures["killed"]
    assert killed["parts_at_kill"] >= 2 and killed["resumed_parts_written"] >= 1
    assert killed["same_parts_as_shared"] and killed["duplicate_parts"] == 0 and killed["verify_status"] == 0
    assert killed["samples"] == killed["data_samples"] > 0
    shared = figures["shared"]
    assert shared["verify_status"] == 0 and len(shared["per_rank_tokens_per_second"]) == 2
    assert 1.5 * figures["single"]["tokens"] < shared["tokens"] < 2.5 * figures["single"]["tokens"]
    # bench/gpu_hours.py counts every rank's GPU for the extraction's hours.
    (row,) = gpu_hours.gpu_hours(figures, {"context_tokens_per_second": 1e5, "processes": 1})
    assert row.extract_gpu_hours == pytest.approx(2 * 1e9 / figures["extract"]["bf16"]["tokens_per_second"] / 3600)
    assert "on 2 GPUs" in row.what
    assert not (tmp_path / "work").exists()  # removed without --keep


def test_a_plan_trades_disk_for_re_extraction_between_offline_and_online():
    def plan(budget):
        return gpu_hours.make_plan(tokens=1e9, epochs=6, codec="fp8", disk_budget=budget, hidden_size=4096, layers=5,
                                   extract_tokens_per_second=10_000.0, train_tokens_per_second=20_000.0)

    whole = plan(None)
    # By hand: 1e9 tokens x (5 x 4096 x 2 B / 2.383 + 8 B of ids and masks + 64 B of the top-8 ids and
    # log-probs, today's default); extraction 1e9 / 1e4 s = 27.78 h.
    assert whole.disk_bytes == pytest.approx(1e9 * (40960 / 2.383 + 8 + 64))
    assert whole.extract_hours == pytest.approx(27.7778, abs=1e-3)
    assert whole.follow_hours == whole.offline_hours  # no budget: extract once
    assert plan(2 * whole.disk_bytes).follow_hours == whole.offline_hours
    half = plan(whole.disk_bytes / 2)  # half of each later epoch re-extracted: 1 + 5 x 0.5 extractions
    assert half.follow_hours == pytest.approx(whole.extract_hours * 3.5 + whole.train_hours)
    assert whole.offline_hours < half.follow_hours < plan(1.0).follow_hours
    assert plan(1.0).follow_hours == pytest.approx(whole.online_hours, rel=1e-6)  # ~nothing kept: online's cost
    text = gpu_hours.format_plan(half, 14_500.0, 8)
    assert "follow with the budget (50% of the cache kept; 2.50 re-extractions)" in text


def test_an_extract_bench_entry_names_its_own_top1_share_and_top_k():
    import bench_extract

    assert bench_extract.parse_topk("bf16:0@8") == ("bf16:0", 8)
    assert bench_extract.parse_codec("bf16:0@8") == ("bf16", 0.0)
    assert bench_extract.parse_topk("fp8") == ("fp8", None) and bench_extract.parse_codec("fp8") == ("fp8", None)
    with pytest.raises(SystemExit, match="top-k to store"):
        bench_extract.parse_topk("bf16@eight")

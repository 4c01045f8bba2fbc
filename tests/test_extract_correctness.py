"""The cache holds exactly what the target computes: per-sample HF hidden states, ids, masks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import expected_mask, random_records, write_jsonl
from dflash.cache_tools.layers import default_target_layer_ids
from dflash.extract.batching import group_by_budget
from dflash.extract.config import ExtractConfig
from dflash.extract.pipeline import run_extraction
from dflash.extract.target import LayerCapture
from extract_utils import cache_contents, make_target, run_cli
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("qwen3-single") / "model", "qwen3")


def reference_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """HF's own per-sample (unpadded) hidden_states[l + 1], concatenated layer-major."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[lid + 1][0] for lid in layer_ids], dim=1)


def test_default_layer_rule_matches_dflash():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]


def test_batches_respect_the_token_budget_and_cover_every_sample():
    lengths = [5, 80, 17, 17, 3, 200, 64, 1]
    groups = group_by_budget(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) * longest <= 128 or len(g) == 1
    assert groups == group_by_budget(lengths, 128)  # deterministic


@pytest.mark.parametrize("token_budget", [1, 200], ids=["one-sample-batches", "padded-batches"])
def test_cached_states_equal_hf_hidden_states(target, tmp_path, token_budget):
    """fp32 compute: the cache equals HF's per-sample hidden_states[l+1] rounded to bf16.

    Bit-exact when each sample runs alone. In padded batches CPU kernels (SDPA, BLAS) round
    differently at the 1e-8 level, which flips a bf16 rounding in ~1e-4 of the values: those
    may differ by one bf16 ulp, nothing more.
    """
    records = random_records(16, seed=1)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    layer_ids = [0, 2, 3]
    # token_budget 200 puts samples of different lengths into one right-padded batch.
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache",
                   "--dtype", "fp32", "--target-layer-ids", "0,2,3", "--part-tokens", 400,
                   "--token-budget", token_budget])
    assert res.exit_code == 0, res.output
    cached = cache_contents(tmp_path / "cache")
    assert sorted(cached) == list(range(len(records)))  # every record once, ids = line order
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    differing = total = 0
    for sid, rec in enumerate(records):
        got = cached[sid]
        np.testing.assert_array_equal(got["input_ids"], rec["input_ids"])
        np.testing.assert_array_equal(got["loss_mask"], expected_mask(rec))
        ref = reference_states(model, rec["input_ids"], layer_ids).to(torch.bfloat16)
        ref_bits = ref.view(torch.int16).numpy().astype(np.int32)
        ulps = np.abs(got["hidden"].astype(np.int32) - ref_bits)
        if token_budget == 1:
            assert ulps.max() == 0, f"sample {sid} is not bit-exact"
        assert ulps.max() <= 1, f"sample {sid} differs by {ulps.max()} bf16 ulps"
        differing += int((ulps > 0).sum())
        total += ulps.size
    assert differing <= total * 1e-3


def test_bf16_compute_matches_within_bf16_rounding(qwen3_target, tmp_path):
    target = qwen3_target
    records = random_records(12, seed=2)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    layer_ids = default_target_layer_ids(6, 3)  # [1, 2, 3]
    cfg = ExtractConfig(target_model=str(target), data=str(data), output=str(tmp_path / "c"),
                        dtype="bf16", token_budget=160, progress=False, target_layer_ids=layer_ids)
    run_extraction(cfg)
    cached = cache_contents(tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    for sid, rec in enumerate(records):
        ref = reference_states(model, rec["input_ids"], layer_ids).float()
        got = torch.from_numpy(cached[sid]["hidden"]).view(torch.bfloat16).float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_forward_stops_after_the_last_captured_layer(qwen3_target):
    model = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    calls: list[str] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_a, i=i: calls.append(f"layer{i}"))
    model.model.norm.register_forward_hook(lambda *_a: calls.append("norm"))
    model.lm_head.register_forward_hook(lambda *_a: calls.append("lm_head"))
    capture = LayerCapture(model, [1, 2], need_last=False)
    ids = torch.randint(0, 128, (2, 7))
    cap = capture(ids, torch.ones_like(ids))
    assert calls == ["layer0", "layer1", "layer2"]
    assert [t.shape for t in cap.layers] == [torch.Size([2, 7, 64])] * 2


def test_capture_skips_the_packed_sequence_check(qwen3_target, monkeypatch):
    """transformers' packed-sequence check syncs the host with the GPU in every forward; our
    rows are never packed, so the capture skips it, restores it, and the states are unchanged."""
    import transformers.masking_utils as masking

    calls = []
    original = masking.find_packed_sequence_indices

    def counting(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", counting)
    model = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (3, 9))
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    assert calls, "this transformers version no longer runs the check: the bypass is dead code"
    calls.clear()
    capture = LayerCapture(model, [0, 2], need_last=False)
    cap = capture(ids, None)
    assert calls == []
    assert masking.find_packed_sequence_indices is counting
    torch.testing.assert_close(cap.layers[0], ref[1], rtol=0, atol=0)
    torch.testing.assert_close(cap.layers[1], ref[3], rtol=0, atol=0)


def test_fp8_cache_with_last_hidden_and_topk(qwen3_target, tmp_path):
    target = qwen3_target
    records = random_records(8, seed=3)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    cfg = ExtractConfig(target_model=str(target), data=str(data), output=str(tmp_path / "c"),
                        dtype="fp32", codec="fp8", store_last_hidden=True, store_topk=4,
                        target_layer_ids=[1, 3], token_budget=120, progress=False)
    run_extraction(cfg)
    cached = cache_contents(tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    last_pre_norm = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _i, o: last_pre_norm.update(h=o))
    for sid, rec in enumerate(records):
        with torch.inference_mode():
            out = model(torch.tensor([rec["input_ids"]]), output_hidden_states=True)
        ref = torch.cat([out.hidden_states[2][0], out.hidden_states[4][0]], dim=1)
        got = torch.from_numpy(cached[sid]["hidden"]).view(torch.bfloat16).float()
        assert torch.nn.functional.cosine_similarity(got, ref, dim=1).min() > 0.998
        lh = cached[sid]["last_hidden"].float()
        assert torch.nn.functional.cosine_similarity(lh, last_pre_norm["h"][0], dim=1).min() > 0.998
        lp_ref, ids_ref = torch.log_softmax(out.logits[0].float(), -1).topk(4, dim=-1)
        assert torch.equal(cached[sid]["topk_ids"], ids_ref)
        torch.testing.assert_close(cached[sid]["topk_logprobs"], lp_ref, rtol=1e-4, atol=1e-4)


def test_nf4_extraction_end_to_end_then_info_and_verify(qwen3_target, tmp_path):
    """dflash-extract --codec nf4 writes a cache that reads back within nf4's bound of the
    target's states (last_hidden too), that `info` reports at <= 0.30x of raw bf16 for the
    hidden states, and that `verify` passes."""
    from click.testing import CliRunner
    from dflash.cache_tools.cli import main as cache_main

    records = random_records(8, seed=4)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    cfg = ExtractConfig(target_model=str(qwen3_target), data=str(data), output=str(tmp_path / "c"),
                        dtype="fp32", codec="nf4", store_last_hidden=True, target_layer_ids=[1, 3],
                        token_budget=120, progress=False)
    run_extraction(cfg)
    cached = cache_contents(tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    for sid, rec in enumerate(records):
        with torch.inference_mode():
            out = model(torch.tensor([rec["input_ids"]]), output_hidden_states=True)
        for layer, ref in enumerate((out.hidden_states[2][0], out.hidden_states[4][0])):
            got = torch.from_numpy(cached[sid]["hidden"]).view(torch.bfloat16).float()[:, layer * 64:(layer + 1) * 64]
            rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
            assert float(rel.max()) <= 0.15 and float(rel.mean()) > 0.01
        assert torch.nn.functional.cosine_similarity(cached[sid]["last_hidden"].float(),
                                                     out.hidden_states[-1][0], dim=1).min() > 0.97
    runner = CliRunner()
    info = json.loads(runner.invoke(cache_main, ["info", str(tmp_path / "c"), "--json"]).output)
    assert info["codec"]["name"] == "nf4"
    hidden_bytes = sum(f.stat().st_size for f in (tmp_path / "c" / "parts").glob("*/hidden/c/*"))
    assert hidden_bytes <= 0.30 * info["raw_bf16_bytes"] * 2 / 3  # hidden: 2 of the 3 layer-widths
    res = runner.invoke(cache_main, ["verify", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output


def test_fp8_quantizer_falls_back_to_eager_when_compiling_fails(monkeypatch):
    from dflash.extract import engine
    from dflash.extract.codecs import quantize_fp8
    from dflash.runtime.findings import collected

    def broken(*_a, **_k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    with collected() as notes:
        assert engine._compiled_quantizer(torch.device("cpu"), [(2, 8)]) is quantize_fp8
    assert [(n.code, n.fields["part"]) for n in notes] == [("extract.runs-unfused", "quantization")]
    assert "no compiler here" in notes[0].fields["error"]


def test_the_compiled_head_keeps_inductor_s_split_reduction_notice_out_of_the_output(monkeypatch):
    # on CUDA inductor warns, in six lines, that it split the reduction over a long vocabulary row
    # (a choice of its own); the other warnings of the compile still reach the user
    import warnings

    from dflash.extract import engine
    from dflash.extract.target import next_token_reducer

    def compile_that_warns(fn, **_kw):
        def call(*args):
            warnings.warn("\nOnline softmax is disabled on the fly since Inductor decides to\nsplit the reduction.",
                          UserWarning, stacklevel=2)
            warnings.warn("a warning of another kind", UserWarning, stacklevel=2)
            return fn(*args)
        return call

    monkeypatch.setattr(torch, "compile", compile_that_warns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine._compiled_head(next_token_reducer(4, True), torch.device("cpu"), 64, torch.bfloat16)
    messages = [str(w.message) for w in seen]
    assert not any("Online softmax" in m for m in messages)
    assert "a warning of another kind" in messages

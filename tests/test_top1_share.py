"""The target's top-1 for the held-out share only (dflash-extract --top1-share): the split's
score in the cache contract, which samples carry a top-1, and what the stages make of the rest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_train_config, write_jsonl
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.sample_scores import heldout_scores, subset_scores, top1_selected
from dflash.extract.target import LayerCapture
from dflash.train.data.caches import open_training_data
from dflash.train.data.loader import sample_tensors
from dflash.train.loss.objective import LossOutput
from dflash.train.measure.metrics import VerificationWalk, greedy_path, greedy_replay, top1_known
from extract_utils import run_cli
from test_target_families import FAMILIES, periodic_records, save_target
from transformers import AutoModelForCausalLM

MASK64 = (1 << 64) - 1


def splitmix64_unit(x: int) -> float:
    """splitmix64 in Python integers, mapped to [0, 1): the reference of the split's score."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def prompt_key(input_ids, loss_mask) -> int:
    """The split key by hand: blake2b-8 of the int32 ids before the first loss token (all of them
    without one), read as a little-endian int64."""
    ids, mask = [int(x) for x in input_ids], [int(m) for m in loss_mask]
    start = mask.index(1) if 1 in mask else len(ids)
    body = b"".join(i.to_bytes(4, "little", signed=True) for i in ids[:start])
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little", signed=True)


def sample_key(sample: dict) -> np.ndarray:
    return np.array([prompt_key(sample["input_ids"].tolist(), sample["loss_mask"].tolist())], np.int64)


def test_the_split_score_is_splitmix64_of_the_sample_id_so_existing_splits_stay_put():
    ids = np.array([0, 1, 2, 7, 1000, 123_456_789, 2**40 + 5, -3], dtype=np.int64)
    expected = [splitmix64_unit(int(i) & MASK64) for i in ids]
    assert heldout_scores(ids).tolist() == expected
    assert subset_scores(ids).tolist() == [splitmix64_unit((int(i) & MASK64) ^ 0x5DEECE66D2545F49) for i in ids]


def test_top1_share_selects_the_samples_the_split_holds_out_first():
    ids = np.arange(20_000, dtype=np.int64)
    scores = heldout_scores(ids)
    assert top1_selected(ids, 1.0).all() and not top1_selected(ids, 0.0).any()
    chosen = top1_selected(ids, 0.05)
    assert abs(chosen.mean() - 0.05) < 0.006
    held_out = scores < 0.02  # the trainer's default --eval-fraction
    assert chosen[held_out].all()  # every held-out sample of a smaller fraction has its top-1
    # per-id shares (several caches read together)
    shares = np.where(ids % 2 == 0, 1.0, 0.0)
    assert np.array_equal(top1_selected(ids, shares), ids % 2 == 0)


# -- extraction: the top-1 of the selected samples only ------------------------------------------

SHARE = 0.5  # about half of the 12 samples: selected and non-selected ones in most batches


def extract_cache(tmp_path: Path, target: Path, name: str, *extra: str, records: list[dict] | None = None) -> Path:
    """A cache of the target's top-1 as --top1-share selects it: without the top-k log-probs
    (--store-topk 0) unless `extra` asks for them, since a top-k holds every sample's top-1."""
    data = write_jsonl(tmp_path / f"{name}.jsonl", records or periodic_records())
    cache = tmp_path / name
    topk = () if "--store-topk" in extra else ("--store-topk", "0")
    result = run_cli(["--target-model", target, "--data", data, "--output", cache, "--dtype", "fp32",
                      "--target-layer-ids", "1,3", "--part-tokens", "200", "--token-budget", "256",
                      "--num-writers", "0", *topk, *extra])
    assert result.exit_code == 0, result.output
    return cache


def own_argmax(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids.long()[None]).logits[0].float().argmax(-1)


def test_stored_top1_of_selected_samples_is_the_argmax_of_the_targets_own_forward_in_every_family(tmp_path):
    for family, (make_config, _drafter) in sorted(FAMILIES.items()):
        target, model = save_target(tmp_path / f"target-{family}", make_config())
        cache = extract_cache(tmp_path, target, f"cache-{family}", "--top1-share", str(SHARE))
        assert read_manifest(cache).top1_share == SHARE
        reader = CacheReader(cache)
        known = []
        for i in range(len(reader)):
            sample = sample_tensors(reader.read_sample(i))
            chosen = bool(top1_selected(sample_key(sample), SHARE)[0])  # by its prompt's key
            assert sample["top1_known"] == chosen
            known.append(chosen)
            top1 = sample["top1_ids"][:, 0].long()
            if chosen:
                assert torch.equal(top1, own_argmax(model, sample["input_ids"])), (family, i)
            else:
                assert not top1.any(), (family, i)  # no top-1 computed for it
        assert any(known) and not all(known), family
        reader.close()


def _tiny_qwen3():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES["qwen3"][0]()).eval()


def _last_layer_rows(model: torch.nn.Module) -> tuple[list[int], object]:
    seen: list[int] = []

    def count(_module, args, kwargs):
        seen.append(int((args[0] if args else kwargs["hidden_states"]).shape[0]))

    return seen, model.model.layers[-1].register_forward_pre_hook(count, with_kwargs=True)


def _reference_last_layer(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # HF's hidden_states[N] is after the final norm: hook the last layer itself
        got = {}
        handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: got.update(h=o[0] if isinstance(o, tuple) else o))
        model.model(input_ids=ids, use_cache=False)
        handle.remove()
    return got["h"]


def test_only_the_selected_rows_run_past_the_captured_layers_and_a_batch_without_any_pays_nothing():
    model = _tiny_qwen3()
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    expected = _reference_last_layer(model, ids[[1, 3]])
    seen, handle = _last_layer_rows(model)
    capture = LayerCapture(model, [1, 3], need_last=False, top1_rows=True)
    try:
        got = capture(ids, None, rows=torch.tensor([1, 3]))
        assert seen == [2]  # the last layer ran on the two selected rows only
        torch.testing.assert_close(got.rows_last_hidden, expected, rtol=1e-5, atol=1e-5)
        none = capture(ids, None, rows=torch.zeros(0, dtype=torch.long))
        assert seen == [2] and none.rows_last_hidden is None  # no layer past layer 3 ran
        assert capture.full_forwards == 0
    finally:
        capture.close()
        handle.remove()


def test_layer_inputs_that_cannot_be_cut_by_row_fall_back_to_a_forward_of_those_rows():
    model = _tiny_qwen3()
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(2))
    expected = _reference_last_layer(model, ids[[0, 2]])

    class Opaque:  # a layer input of no known kind (as a flex-attention BlockMask would be)
        pass

    inject = model.model.layers[4].register_forward_pre_hook(lambda m, a, k: (a, {**k, "opaque": Opaque()}),
                                                              with_kwargs=True)
    capture = LayerCapture(model, [1, 3], need_last=False, top1_rows=True)
    try:
        got = capture(ids, None, rows=torch.tensor([0, 2]))
        assert capture.full_forwards == 1
        torch.testing.assert_close(got.rows_last_hidden, expected, rtol=1e-5, atol=1e-5)
    finally:
        capture.close()
        inject.remove()


def hidden_bits(cache: Path) -> dict[int, np.ndarray]:
    reader = CacheReader(cache)
    try:
        return {s["sample_id"]: s["hidden"].view(torch.int16).numpy().copy()
                for s in (sample_tensors(reader.read_sample(i)) for i in range(len(reader)))}
    finally:
        reader.close()


def test_share_one_is_the_cache_of_before_and_no_share_changes_the_hidden_state_bytes(tmp_path):
    target, model = save_target(tmp_path / "target", FAMILIES["qwen3"][0]())
    full = extract_cache(tmp_path, target, "full", "--top1-share", "1")
    header = json.loads((full / "manifest.json").read_text())
    assert "top1_share" not in header["extras"] and header["extras"]["top1"] == "uint16"  # the header of before
    reader = CacheReader(full)
    for i in range(len(reader)):
        sample = sample_tensors(reader.read_sample(i))
        assert sample["top1_known"] and torch.equal(sample["top1_ids"][:, 0].long(), own_argmax(model, sample["input_ids"]))
    reader.close()
    # batches where no sample is selected (a share too small for any of the 12) store zeros and no share leaks
    # into the hidden states: bf16 bytes equal across shares and without top-1
    tiny = extract_cache(tmp_path, target, "tiny", "--top1-share", "0.001")
    assert not any(CacheReader(tiny).read_sample(i)["top1_known"] for i in range(12))
    half = extract_cache(tmp_path, target, "half", "--top1-share", str(SHARE))
    off = extract_cache(tmp_path, target, "off", "--no-store-top1")
    assert read_manifest(off).top1 is None and read_manifest(off).top1_share == 0.0
    zero = extract_cache(tmp_path, target, "zero", "--top1-share", "0")
    assert read_manifest(zero).top1 is None  # share 0 is the off switch too
    reference = hidden_bits(full)
    for other in (tiny, half, off, zero):
        got = hidden_bits(other)
        assert sorted(got) == sorted(reference)
        for sid in reference:
            np.testing.assert_array_equal(got[sid], reference[sid])


# -- the trainer: held-out samples with and without their top-1 ----------------------------------


def test_a_sample_without_its_top1_is_replayed_against_its_own_tokens_and_never_counts_as_greedy():
    # Two rows, blocks of 4 at anchors 0 and 3. Row 0 has its top-1 (99 at row 2: the target
    # would not write token 3 = 13); row 1 has none (zeros): it is checked against its tokens.
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]] * 2)
    top1 = torch.tensor([[11, 12, 99, 14, 15, 16, 17, 0], [0] * 8])
    predicted = torch.tensor([[[11, 12, 13], [14, 99, 16]]] * 2)
    labels = torch.tensor([[[11, 12, 13], [14, 15, 16]]] * 2)
    valid = torch.ones(2, 2, 3, dtype=torch.bool)
    out = LossOutput(loss=torch.zeros(()), ce=torch.zeros(()), kl=None, correct=(predicted == labels) & valid,
                     valid=valid, anchor_positions=torch.tensor([[0, 3]] * 2),
                     anchor_valid=torch.ones(2, 2, dtype=torch.bool), predicted=predicted)
    batch = {"input_ids": input_ids, "top1_ids": top1[..., None], "top1_known": torch.tensor([True, False]),
             "lengths": torch.tensor([8, 8])}
    replayed = greedy_replay(out, batch)
    assert replayed.correct[0].tolist() == [[True, True, False], [True, False, True]]  # the target's top-1
    assert torch.equal(replayed.correct[1], out.correct[1])  # its own tokens: as without top-1
    path = greedy_path(batch)
    assert not path[0, 3] and path[1].all()  # row 0 leaves the greedy path at token 3, row 1 is its own path
    assert top1_known(batch).tolist() == [True, False]
    eligible = torch.zeros(2, 8, dtype=torch.bool)
    eligible[:, [0, 3]] = True
    walk = VerificationWalk((4,))
    walk.update([out], eligible, torch.ones(2, 8, dtype=torch.bool), top1_known(batch))
    assert walk.greedy.samples == 1 and walk.others.samples == 1  # the row without top-1 is no greedy completion


def share_cache(tmp_path: Path, target: Path, share: float, *extra: str) -> Path:
    records = [{"input_ids": [int(x) for x in torch.randint(0, 128, (12 + i % 7,), generator=torch.Generator().manual_seed(i))],
                "loss_mask": [0] * 3 + [1] * (9 + i % 7)} for i in range(60)]
    return extract_cache(tmp_path, target, f"share-{share}{''.join(extra)}", "--top1-share", str(share), *extra,
                         records=records)


def test_the_startup_summary_warns_when_the_heldout_split_is_larger_than_the_top1_share(tmp_path):
    target, _ = save_target(tmp_path / "target", FAMILIES["qwen3"][0]())
    cache = share_cache(tmp_path, target, 0.2)

    def summary(**kw) -> tuple[dict, int, int]:
        cfg = tiny_train_config(cache, target, tmp_path / "run", eval_max_samples=0, **kw)
        data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
        data.loader.close()
        return {f.code: f.fields for f in data.caveats()}, data.eval_without_top1, len(data.eval_indices)

    found, missing, evaluated = summary(eval_fraction=0.15)
    assert missing == 0 and "train.heldout-some-top1" not in found  # every held-out sample has its top-1
    found, missing, evaluated = summary(eval_fraction=0.6)
    ids = CacheReader(cache)
    scores = [heldout_scores(sample_key(ids.read_sample(i)))[0] for i in range(len(ids))]
    held = [s for s in scores if s < 0.6]
    expected = sum(1 for s in held if s >= 0.2)
    assert evaluated == len(held) and missing == expected > 0
    assert found["train.heldout-some-top1"] == dict(samples=missing, evaluated=evaluated, top1_share=[0.2])
    # dflash-extract's default top-8 log-probs hold every sample's top-1: nothing is missing
    cache = share_cache(tmp_path, target, 0.2, "--store-topk", "8")
    found, missing, evaluated = summary(eval_fraction=0.6)
    assert evaluated == len(held) and missing == 0 and "train.heldout-some-top1" not in found


def test_cache_info_says_how_many_samples_hold_their_top1_and_verify_passes(tmp_path):
    from click.testing import CliRunner
    from dflash.cache_tools.cli import main as cache_main

    target, _ = save_target(tmp_path / "target", FAMILIES["qwen3"][0]())
    cache = share_cache(tmp_path, target, 0.3)
    reader = CacheReader(cache)
    known = sum(reader.read_sample(i)["top1_known"] for i in range(len(reader)))
    reader.close()
    info = CliRunner().invoke(cache_main, ["info", str(cache), "--json"])
    assert info.exit_code == 0, info.output
    summary = json.loads(info.stdout)
    assert summary["top1_share"] == 0.3 and summary["top1_samples"] == known > 0
    text = CliRunner().invoke(cache_main, ["info", str(cache)]).stdout
    assert f"top1=uint16 for {known} of 60 samples (--top1-share 0.3" in text
    verify = CliRunner().invoke(cache_main, ["verify", str(cache)])
    assert verify.exit_code == 0, verify.output


def test_the_share_is_cache_identity_a_resume_with_another_is_refused_naming_it(tmp_path):
    target, _ = save_target(tmp_path / "target", FAMILIES["qwen3"][0]())
    cache = extract_cache(tmp_path, target, "cache", "--top1-share", "0.3")
    data = tmp_path / "cache.jsonl"
    base = ["--target-model", target, "--data", data, "--output", cache, "--dtype", "fp32", "--target-layer-ids", "1,3",
            "--part-tokens", "200", "--token-budget", "256", "--num-writers", "0", "--store-topk", "0"]
    again = run_cli([*base, "--top1-share", "0.3"])
    assert again.exit_code == 0, again.output  # the same share resumes
    other = run_cli(base)  # the default share
    assert other.exit_code == 2 and "extras.top1_share" in other.output and "Traceback" not in other.output
    bad = run_cli([*base, "--top1-share", "1.5"])
    assert bad.exit_code == 2 and "--top1-share must be between 0 and 1" in bad.output


def test_the_quality_bench_extracts_the_caches_it_estimates_on_whole_with_every_top1(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "quality"))
    import stages

    calls = []

    def fake(name, module, args, log_path, stdout=None, env=None):
        calls.append(args)
        return 1.0

    monkeypatch.setattr(stages, "run_command", fake)
    def shares(root, sizes):  # each cache's --top1-share as stage_extract passes it (None: the default)
        calls.clear()
        stages.stage_extract(stages.Work(root=root, sizes=sizes, device="cpu", log=lambda *a: None))
        return {Path(a[a.index("--output") + 1]).name: a[a.index("--top1-share") + 1] if "--top1-share" in a else None
                for a in calls}

    small = stages.preset(small=True)
    assert shares(tmp_path, small) == {"cache": None, "estimate_cache": "1", "decoded_cache": "1"}
    # train_top1_share sets the training cache's share, for a larger held-out split
    raised = shares(tmp_path / "raised", dataclasses.replace(small, train_top1_share=0.12))
    assert raised == {"cache": "0.12", "estimate_cache": "1", "decoded_cache": "1"}


def test_caches_of_two_shares_train_together_and_a_hand_edited_share_is_named(tmp_path):
    from dflash.cache_tools.cache_set import CacheSet
    from dflash.cache_tools.errors import CacheCorruptError
    from dflash.train.data.heldout import without_top1

    target, _ = save_target(tmp_path / "target", FAMILIES["qwen3"][0]())
    a, b = share_cache(tmp_path, target, 0.3), share_cache(tmp_path, target, 1.0)
    both = CacheSet([str(a), str(b)], max_seq_len=64)  # no refusal: each sample says whether it has its top-1
    index = np.arange(len(both))
    expected = int((heldout_scores(both.split_keys()[:60]) >= 0.3).sum())  # cache a's samples outside 0.3
    assert without_top1(both, index) == expected > 0
    header = json.loads((a / "manifest.json").read_text())
    header["extras"]["top1_share"] = 1.5
    (a / "manifest.json").write_text(json.dumps(header))
    with pytest.raises(CacheCorruptError) as err:
        read_manifest(a)
    assert err.value.code == "cache.manifest-invalid" and err.value.fields["file"] == str(a / "manifest.json")
    assert (err.value.fields["key"], err.value.fields["problem"], err.value.fields["value"]) == \
        ("extras.top1_share", "not-a-share", "1.5")  # the key, what is wrong with it and its value

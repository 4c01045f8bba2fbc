"""Honest training metrics: the held-out split (on by default, stable as caches grow), the
reports that lead with held-out tau, and the best held-out checkpoint as the exported drafter."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    HIDDEN,
    TARGET_LAYERS,
    block_metrics,
    random_records,
    read_metrics,
    tiny_train_config,
    write_jsonl,
    write_tiny_cache,
)
from conftest import WORLD_VOCAB as VOCAB
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import (
    LOG_FILE,
    PartRecord,
    encode_log_line,
    make_header,
    read_manifest,
)
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.findings import collected
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.data.caches import open_training_data
from dflash.train.data.heldout import eval_split
from dflash.train.loss.objective import LossOutput
from dflash.train.measure.metrics import VerificationWalk, greedy_replay
from dflash.train.run.loop import train
from extract_utils import make_target, run_cli
from safetensors.torch import load_file

EXTRACT = ["--dtype", "fp32", "--target-layer-ids", "1,2", "--token-budget", "128", "--sort-window-tokens", "0",
           "--num-writers", "0"]


def heldout_ids(cache_dirs: list[Path], fraction: float) -> tuple[set[int], set[int]]:
    """(held-out, training) global sample ids of the caches read together."""
    caches = CacheSet([str(c) for c in cache_dirs], max_seq_len=512)
    train_idx, held_idx = eval_split(caches, fraction)
    ids = caches.sample_ids()
    return set(ids[held_idx].tolist()), set(ids[train_idx].tolist())


# -- the split ----------------------------------------------------------------------------------


def test_heldout_split_is_stable_when_a_cache_grows(tmp_path):
    target = make_target(tmp_path / "target", layers=4)
    records = random_records(120, seed=5, min_len=4, max_len=40)
    # The same first 60 records, then a superset of 120, extracted with other part sizes (so the
    # samples sit at other positions in other parts).
    small = tmp_path / "small"
    grown = tmp_path / "grown"
    for data, out, part_tokens in ((records[:60], small, "150"), (records, grown, "400")):
        result = run_cli(["--target-model", target, "--data", write_jsonl(tmp_path / f"{out.name}.jsonl", data),
                          "--output", out, "--part-tokens", part_tokens, *EXTRACT])
        assert result.exit_code == 0, result.output
    assert len(read_manifest(small).parts) != len(read_manifest(grown).parts)

    old_held, old_train = heldout_ids([small], 0.2)
    new_held, new_train = heldout_ids([grown], 0.2)
    assert len(old_held) >= 5 and len(old_train) >= 30 and len(old_held | old_train) == 60
    assert old_held <= new_held, "a sample once held out went into training"
    assert not old_train & new_held, "a sample trained on became held out"
    assert new_held - old_held, "the new samples are split too"
    # The order in which the caches are listed does not move a sample either.
    both_held, _ = heldout_ids([grown, small], 0.2)
    assert both_held == heldout_ids([small, grown], 0.2)[0] == new_held

    # The trainer's own split (the default settings) and its evaluation cap agree.
    def data(cache: Path, **kw):
        cfg = TrainConfig.from_dict(dict(cache=[str(cache)], target_model=str(target), num_workers=0, max_seq_len=64,
                                         output_dir=str(tmp_path / "unused"), token_budget=128, max_batch_size=4, **kw))
        d = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
        ids = d.caches.sample_ids()
        return set(ids[d.train_indices].tolist()), set(ids[d.eval_indices].tolist())

    small_train, small_eval = data(small, eval_fraction=0.2, eval_max_samples=6)
    grown_train, grown_eval = data(grown, eval_fraction=0.2, eval_max_samples=6)
    assert len(small_eval) == len(grown_eval) == 6
    assert small_train == old_train and small_train <= grown_train
    assert grown_eval & old_held <= small_eval, "the cap never brings an old sample into evaluation"


def test_heldout_split_is_on_by_default_and_eval_cache_replaces_it(tiny_world, tmp_path, monkeypatch):
    def data(**kw):
        cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "unused", **kw)
        return open_training_data(cfg, rank=0, world_size=1, pin_memory=False)

    defaults = TrainConfig.from_dict(dict(cache=["c"], target_model="t", output_dir="o"))
    assert defaults.data.eval_fraction > 0 and defaults.logging.eval_interval is None
    assert defaults.logging.eval_every(1000) == 100 and defaults.logging.eval_every(7) == 1
    on = data(eval_fraction=0.25)
    assert on.heldout_count == len(on.eval_indices) > 0
    assert len(on.train_indices) + on.heldout_count == len(on.caches)
    caveats = {f.code: f.fields for f in on.caveats()}
    assert caveats["train.few-heldout"] == {"samples": len(on.eval_indices)}  # a dozen held-out samples: said so
    assert caveats["train.few-training-samples"] == {"samples": len(on.train_indices)}  # and a few dozen training ones
    # its advice names dflash-generate's flag for more answers per prompt, which exists
    from dflash.prepare.driver import GenerateConfig
    from dflash.runtime.findings import render

    few = next(f for f in on.caveats() if f.code == "train.few-training-samples")
    assert "--samples-per-prompt 3" in render(few) and "samples_per_prompt" in GenerateConfig.__dataclass_fields__
    from dflash.train.data import caches as training_data

    monkeypatch.setattr(training_data, "FEW_TRAINING", len(on.train_indices))  # as many as the notice asks for
    assert "train.few-training-samples" not in {f.code for f in on.caveats()}
    off = data(eval_fraction=0)
    assert off.heldout_count == 0 and len(off.train_indices) == len(off.caches)
    assert "train.no-heldout" in {f.code for f in off.caveats()}
    other = write_tiny_cache(tmp_path / "other", samples=8, parts=2, seed=9)
    separate = data(eval_fraction=0.25, eval_cache=[str(other)])
    assert len(separate.train_indices) == len(separate.caches) and separate.heldout_count == 8
    # the split's samples are a draw of the training data, and are set beside it; an --eval-cache's
    # are not (greedy completions of other prompts are surer and repeat themselves more by kind)
    assert on.text_samples() is not None and on.text_lookup(4) is not None
    assert separate.text_samples() is None and separate.training_confidence is None
    assert separate.text_lookup(4) is None and separate.heldout_text_lookup(4) is None
    assert separate.unlike_heldout_note(4) is None


def test_max_train_samples_draws_a_nested_subset_of_the_training_side_only(tiny_world, tmp_path):
    def data(**kw):
        cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "unused",
                                eval_fraction=0.25, **kw)
        d = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
        ids = d.caches.sample_ids()
        return d, set(ids[d.train_indices].tolist()), set(ids[d.eval_indices].tolist())

    full, full_train, full_eval = data()
    n = len(full_train)
    assert n >= 8, "the tiny world needs a few dozen training samples for this test"
    half, half_train, half_eval = data(max_train_samples=n // 2)
    quarter, quarter_train, _ = data(max_train_samples=n // 4)
    assert len(half_train) == n // 2 and len(quarter_train) == n // 4
    assert quarter_train < half_train < full_train, "a larger cap keeps every sample of a smaller one"
    assert half_eval == full_eval, "the held-out samples do not move with the cap"
    assert "--max-train-samples" in half.summary() and "--max-train-samples" not in full.summary()
    assert half.loader.total_steps < full.loader.total_steps
    _, all_train, _ = data(max_train_samples=10 * n)  # a cap above the data is no cap
    assert all_train == full_train
    with pytest.raises(TrainConfigError) as refused:
        tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "unused", max_train_samples=-1)
    assert refused.value.code == "train.setting-range"
    assert (refused.value.fields["flag"], refused.value.fields["value"]) == ("--max-train-samples", -1)


@pytest.mark.parametrize("ids_in_log", [True, False], ids=["ids-in-the-commit-log", "older-commit-log"])
def test_startup_with_the_split_reads_only_the_sample_ids_of_10000_parts(tiny_world, tmp_path, ids_in_log):
    cache = write_tiny_cache(tmp_path / "cache", samples=2, parts=1, min_len=20, max_len=24)
    template = cache / "parts" / "part-000000"
    record = read_manifest(cache).parts[0]
    assert record.sample_ids == (0, 1)  # a writer records them
    if not ids_in_log:  # a cache committed before the records listed the sample ids
        record = PartRecord(**{**record.__dict__, "sample_ids": None})
    with open(cache / LOG_FILE, "wb") as f:
        for p in range(10_000):
            name = f"part-{p:06d}"
            if p:
                os.symlink(template, cache / "parts" / name)
            f.write(encode_log_line(PartRecord(**{**record.__dict__, "name": name})))
    config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", max_steps=1, epochs=1)
    opened: list[str] = []
    _RECORDING.append(opened)
    start = time.perf_counter()
    try:
        data = open_training_data(config, rank=0, world_size=1, pin_memory=False)
    finally:
        _RECORDING.clear()
    elapsed = time.perf_counter() - start
    assert len(data.caches) == 20_000
    inside = {p.split("/parts/")[1].split("/", 1)[1] for p in opened if "/parts/" in p}
    if ids_in_log:
        assert inside == set(), "the commit log's sample ids: no part is opened at startup"
    else:
        assert inside == {"sample_ids/zarr.json", "sample_ids/c/0"}, "only the sample ids are read at startup"
    assert sorted(np.unique(data.caches.sample_ids()).tolist()) == [0, 1]
    print(f"split of 10,000 parts: {elapsed:.2f} s")
    assert elapsed < 120, elapsed  # a guard against a pathological regression, not a speed target


_RECORDING: list[list[str]] = []


def _record_opens(event, args):
    if _RECORDING and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDING[0].append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


# -- the run ------------------------------------------------------------------------------------


def test_an_overfitting_run_warns_and_exports_the_best_heldout_checkpoint(tiny_world, tmp_path):
    # 8 training samples of random tokens, 24 epochs: the drafter can only memorize them, so
    # training tau climbs while held-out tau stays at the floor.
    cache = write_tiny_cache(tmp_path / "cache", samples=12, parts=1)
    out = tmp_path / "run"
    settings = dict(epochs=24, eval_fraction=0.34, eval_interval=4, log_interval=4, keep_checkpoints=1, lr=3e-2,
                    max_anchors=16, drafter_type="dflash")  # DFlash memorizes 8 samples within these epochs
    result = train(tiny_train_config(cache, tiny_world["target"], out, **settings))
    records = read_metrics(out)
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) >= 10 and evals[-1]["step"] == result.step
    best = max(evals, key=lambda r: r["heldout_tau"])  # the first of equals: only a rise is an improvement
    assert result.best_step == best["step"] == evals[-1]["best_step"] < result.step, "the scenario overfits"
    assert evals[-1]["train_tau"] > best["train_tau"] + 0.2, "training tau kept rising"
    after = [r for r in evals if r["step"] > best["step"]]
    assert "warning" not in after[0]  # one evaluation below the best may be noise
    said = {"train.heldout-stalled", "train.heldout-overfitting"}
    assert all(r.get("warning_code") in said and r["warning"] for r in after[1:])  # two in a row are not: its text and code
    assert after[-1]["warning_code"] == "train.heldout-overfitting"  # training tau kept rising
    assert not any("warning" in r or "warning_code" in r for r in evals if r["step"] == best["step"])

    # The best checkpoint outlived keep_checkpoints=1; the last one is there too; final/ is the best.
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step-{best['step']:06d}", f"step-{result.step:06d}"]
    exported = load_file(str(out / "final" / "model.safetensors"))
    best_w = load_file(str(out / "checkpoints" / ckpts[0] / "model.safetensors"))
    last_w = load_file(str(out / "checkpoints" / ckpts[1] / "model.safetensors"))
    assert exported.keys() == best_w.keys()
    assert all(torch.equal(exported[k], best_w[k].to(torch.bfloat16)) for k in exported)
    assert not all(torch.equal(exported[k], last_w[k].to(torch.bfloat16)) for k in exported)
    meta = json.loads((out / "checkpoints" / ckpts[1] / "meta.json").read_text())
    assert meta["heldout"]["best_step"] == best["step"]

    # Resumed from the best checkpoint, the run knows it is the best so far: no later
    # evaluation replaces it, and it ends bit for bit as the uninterrupted run did.
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / ckpts[0], resumed / "checkpoints" / ckpts[0])
    again = train(tiny_train_config(cache, tiny_world["target"], resumed, **settings))
    assert again.best_step == result.best_step
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ckpts
    for name in ("final/model.safetensors", f"checkpoints/{ckpts[1]}/model.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(resumed / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert [r.get("warning") for r in read_metrics(resumed) if r["kind"] == "eval"] == [r.get("warning") for r in after]

    # A best checkpoint deleted by hand: rerunning the finished run exports the last step's
    # weights, and says so.
    shutil.rmtree(resumed / "checkpoints" / ckpts[0])
    shutil.rmtree(resumed / "final")
    with collected() as said:
        train(tiny_train_config(cache, tiny_world["target"], resumed, **settings))
    exported = load_file(str(resumed / "final" / "model.safetensors"))
    assert all(torch.equal(exported[k], last_w[k].to(torch.bfloat16)) for k in exported)
    gone = [f for f in said if f.code == "train.best-checkpoint-gone"]
    assert [f.fields["checkpoint"] for f in gone] == [str(resumed / "checkpoints" / ckpts[0])]


def test_metrics_jsonl_carries_heldout_tau_train_tau_and_the_gap(tiny_world, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=12,
                                     eval_fraction=0.25, eval_interval=5, log_interval=2))
    records = read_metrics(out)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [5, 10, 12]  # every --eval-interval steps and at the end
    for r in evals:
        assert list(r)[3:6] == ["heldout_tau", "train_tau", "tau_gap"]  # after step, kind, time
        assert r["heldout_tau"] == r["tau"] and 1.0 <= r["heldout_tau"] <= 4.0
        # the gap compares per-block means on both sides; held-out tau itself is the walk
        assert math.isclose(r["tau_gap"], r["train_tau"] - r["tau_blocks"])
    # train_tau of an evaluation is the training tau of the steps since the one before.
    trains = [r for r in records if r["kind"] == "train"]
    window = [r for r in trains if 5 < r["step"] <= 10]
    expected = 1 + sum((r["tau"] - 1) * r["blocks"] for r in window) / sum(r["blocks"] for r in window)
    assert math.isclose(evals[1]["train_tau"], expected)
    # Training records lead with the latest held-out tau once there is one (an evaluation step
    # logs its training record first).
    for r in trains:
        latest = [e for e in evals if e["step"] < r["step"]]
        if latest:
            assert list(r)[3] == "heldout_tau" and r["heldout_tau"] == latest[-1]["heldout_tau"]
        else:
            assert "heldout_tau" not in r
    assert result.eval_metrics is not None and np.isclose(result.eval_metrics["tau"], evals[-1]["heldout_tau"])
    # no top-k in this cache: checked against its tokens, walked where every anchor was drawn
    assert evals[-1]["walked_samples"] > 0 and evals[-1]["estimator"] == "labels walk"


# -- the estimator ------------------------------------------------------------------------------


def test_greedy_replay_checks_each_slot_against_the_targets_top1():
    # One sequence, blocks of 4 at anchors 0 and 3. Row t of top-1 is the target's greedy
    # choice for token t+1; at row 2 it differs from the sample (99, not 13).
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    top1 = torch.tensor([[11, 12, 99, 14, 15, 16, 17, 0]])
    anchors = torch.tensor([[0, 3]])
    predicted = torch.tensor([[[11, 12, 13], [14, 99, 16]]])
    labels = torch.tensor([[[11, 12, 13], [14, 15, 16]]])
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    out = LossOutput(loss=torch.zeros(()), ce=torch.zeros(()), kl=None, correct=(predicted == labels) & valid,
                     valid=valid, anchor_positions=anchors, anchor_valid=torch.ones(1, 2, dtype=torch.bool),
                     predicted=predicted)
    batch = {"input_ids": input_ids, "topk_ids": torch.stack([top1, torch.zeros_like(top1)], -1)}
    replayed = greedy_replay(out, batch)
    # Block 1: the labels accept all 3 slots, greedy verification stops at the target's 99.
    assert replayed.correct.tolist() == [[[True, True, False], [True, False, True]]]
    assert block_metrics(out.correct, out.valid)["tau"] == 1 + (3 + 1) / 2
    assert block_metrics(replayed.correct, replayed.valid)["tau"] == 1 + (2 + 1) / 2
    assert greedy_replay(out, {"input_ids": input_ids}) is out  # no top-k: the labels


def walk_case(leading: list[list[int]], anchors: list[list[int]], *, slots: int = 3) -> LossOutput:
    """A LossOutput whose block at anchors[b][i] accepts leading[b][i] slots."""
    a = torch.tensor(anchors)
    n = torch.tensor(leading)
    valid = torch.ones(*a.shape, slots, dtype=torch.bool)
    correct = torch.arange(slots)[None, None, :] < n[..., None]
    return LossOutput(loss=torch.zeros(()), ce=torch.zeros(()), kl=None, correct=correct, valid=valid,
                      anchor_positions=a, anchor_valid=torch.ones(a.shape, dtype=torch.bool))


def test_verification_walk_follows_the_blocks_a_decoder_would_verify():
    # Sample 0: positions 2..9 are eligible anchors. Blocks of 4 (3 slots): at 2 accept 3
    # (4 tokens) -> 6 accepts 0 (1 token) -> 7 accepts 2 (3 tokens) -> 10: past the end.
    # The per-block mean over all eight anchors would say 1 + 11/8 = 2.375; the decoder
    # verifies 3 blocks for 8 tokens: 2.667.
    leading = [[3, 3, 3, 3, 0, 2, 2, 2]]
    anchors = [[2, 3, 4, 5, 6, 7, 8, 9]]
    eligible = torch.zeros(1, 12, dtype=torch.bool)
    eligible[0, 2:10] = True
    walk = VerificationWalk((4, 2))
    walk.update([walk_case(leading, anchors)], eligible)
    taus = walk.taus(walk.state())
    assert taus[4] == pytest.approx(8 / 3)
    assert block_metrics(*(lambda o: (o.correct, o.valid))(walk_case(leading, anchors)))["tau"] == 1 + 18 / 8
    # Width 2 (a decoder at --block-size 2 verifies the first draft only): 2 -> 4 -> 6 -> 7 -> 9 -> 11.
    assert taus[2] == pytest.approx((2 + 2 + 1 + 2 + 2) / 5)
    # Blocks of one sample over two anchor chunks walk the same as in one.
    chunked = VerificationWalk((4, 2))
    chunked.update([walk_case([leading[0][:5]], [anchors[0][:5]]), walk_case([leading[0][5:]], [anchors[0][5:]])],
                   eligible)
    assert chunked.taus(chunked.state()) == taus
    # A sample with an eligible position that is not an anchor cannot be walked: left out.
    eligible[0, 10] = True
    skipped = VerificationWalk((4,))
    skipped.update([walk_case(leading, anchors)], eligible)
    assert skipped.samples == 0 and skipped.taus(skipped.state()) == {}


def write_topk_cache(path: Path, *, samples: int = 24, k: int = 2) -> Path:
    """Greedy completions: the target's top-1 at every row is the sample's next token."""
    header = make_header(
        target={"path": "tiny-target", "architecture": "Qwen3ForCausalLM", "hidden_size": HIDDEN,
                "num_hidden_layers": TARGET_LAYERS, "vocab_size": VOCAB},
        target_layer_ids=[1, 2], hidden_size=HIDDEN, codec=HiddenCodec(name="bf16"), chunk_rows=16,
        shard_rows=64, data={"name": "greedy"}, topk=k)
    gen = torch.Generator().manual_seed(3)
    writer = CacheWriter(path, header)
    with writer.part_writer("part-000000") as pw:
        for s in range(samples):
            n = int(torch.randint(12, 40, (1,), generator=gen))
            ids = torch.randint(0, VOCAB - 1, (n,), generator=gen)
            top = torch.stack([torch.roll(ids, -1), (torch.roll(ids, -1) + 1) % VOCAB], -1)
            mask = torch.ones(n, dtype=torch.uint8)
            mask[: n // 4] = 0
            pw.add_sample(s, ids, mask, torch.randn(n, 2 * HIDDEN, generator=gen).to(torch.bfloat16),
                          topk_ids=top.to(torch.int32), topk_logprobs=torch.log_softmax(torch.randn(n, k), -1))
    return path


def test_heldout_tau_is_the_greedy_replay_when_the_cache_holds_topk(tiny_world, tmp_path):
    cache = write_topk_cache(tmp_path / "cache")
    out = tmp_path / "run"
    train(tiny_train_config(cache, tiny_world["target"], out, max_steps=6, eval_fraction=0.3, eval_interval=3))
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals and all(r["estimator"] == "greedy walk" for r in evals)
    # On greedy completions the target's choice is the sample's token: both estimates agree.
    assert all(r["tau_blocks"] == r["tau_labels"] for r in evals)


def test_the_heldout_evaluation_builds_no_autograd_graph(tiny_world, tmp_path, monkeypatch):
    # With a graph, every anchor chunk's activations stay alive until its batch is walked: a
    # held-out batch of a few thousand anchors took tens of GiB and ran out of GPU memory.
    import dflash.train.measure.evaluation as evaluation

    seen = []
    real = evaluation.compute_loss

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((torch.is_grad_enabled(), out.loss.requires_grad))
        return out

    monkeypatch.setattr(evaluation, "compute_loss", recording)
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", max_steps=4,
                                     eval_fraction=0.25, eval_interval=2, log_interval=2))
    assert seen and result.eval_metrics is not None
    assert seen == [(False, False)] * len(seen)


@pytest.mark.parametrize("drafter_type", ["dflash", "dflash2"])
def test_a_run_with_the_head_in_chunks_trains_the_weights_of_one_without(tiny_world, tmp_path, monkeypatch,
                                                                        drafter_type):
    # The chunked head (--logits-chunk-mib, train/loss/head_loss.py) through the whole loop: steps,
    # the held-out evaluation, checkpoints. Here every micro-batch is cut into chunks of 3 slots.
    import dflash.train.loss.objective as objective
    from conftest import final_weights

    extra = dict(drafter_type="dflash2", selector_rank=4, selector_top_k=4) if drafter_type == "dflash2" else {}

    def run(name: str):
        return train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / name, max_steps=6,
                                       eval_fraction=0.25, eval_interval=3, save_interval=6, **extra))

    plain = run("plain")
    monkeypatch.setattr(objective, "needs_chunks", lambda n, vocab, mib: n > 3)
    monkeypatch.setattr(objective, "chunk_rows", lambda vocab, mib: 3)
    chunked = run("chunked")
    a, b = final_weights(tmp_path / "plain"), final_weights(tmp_path / "chunked")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name
    assert chunked.eval_metrics["tau"] == pytest.approx(plain.eval_metrics["tau"], rel=1e-6)


def _tracker_of(trajectory: list[tuple[int, float, float]]):
    from dflash.train.measure.reporting import HeldoutTracker

    tracker = HeldoutTracker()
    for step, heldout_tau, train_tau in trajectory:
        tracker.add_train({"tau": train_tau, "blocks": 100.0})
        tracker.observe(step, {"tau": heldout_tau})
    return tracker


def test_the_end_of_a_run_says_whether_its_data_or_its_steps_limit_it(tmp_path):
    from dflash.train.measure.reporting import HeldoutTracker

    # The BPE benchmark's prose at 32,768 completions: held-out tau flat over the second half
    # while the training batches' tau climbs.
    prose = [(526, 1.946, 2.335), (1052, 2.058, 3.956), (1578, 2.132, 4.526), (2104, 2.179, 4.814),
             (2630, 2.184, 4.996), (3156, 2.195, 5.121), (3682, 2.188, 5.225), (4208, 2.2, 5.31),
             (4734, 2.231, 5.472), (5260, 2.245, 5.712)]
    tracker = _tracker_of(prose)
    advice = tracker.trajectory_advice(5260)
    assert "2.184 (step 2630) -> 2.245 (step 5260, +2.8 %)" in advice and "4.996 -> 5.712 (+14.3 %)" in advice
    assert "the data limits this drafter" in advice and "--samples-per-prompt" in advice
    assert advice in tracker.final_message(5260, tmp_path / "final", None)
    # Restored from a checkpoint's state, the trajectory is the same.
    restored = HeldoutTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.trajectory_advice(5260) == advice

    # Still rising at the last evaluation: more epochs may pay.
    rising = [(s, 1.5 + 0.1 * i, 2.0 + 0.2 * i) for i, s in enumerate(range(100, 1100, 100))]
    assert "still rising, so more --epochs may pay" in _tracker_of(rising).trajectory_advice(1000)
    # ... or, where --max-steps ended the run before its epochs did, more steps
    cut = _tracker_of(rising).final_message(1000, tmp_path / "final", None, cut_short=", ended by --max-steps 1000")
    assert cut.startswith("done: 1000 steps, ended by --max-steps 1000; ") and "more --epochs" not in cut
    assert "still rising, so a larger --max-steps may pay" in cut
    # Level held-out and training tau, too few evaluations, or no evaluation: nothing to say.
    level = [(s, 2.0 + 0.001 * i, 2.2) for i, s in enumerate(range(100, 1100, 100))]
    assert _tracker_of(level).trajectory_advice(1000) is None
    assert _tracker_of(prose[:3]).trajectory_advice(1578) is None
    assert HeldoutTracker().trajectory_advice(10) is None


def test_the_last_line_sets_the_heldout_tau_beside_prompt_lookup_on_the_same_samples_also_after_a_resume(tmp_path):
    from dflash.train.measure.reporting import HeldoutTracker

    tracker = HeldoutTracker()
    tracker.observe(10, {"tau": 2.5, "tau_lookup": 1.25})
    tracker.observe(20, {"tau": 3.0, "tau_lookup": 1.25, "tau_per_sample_mean": 4.5})
    restored = HeldoutTracker()
    restored.load_state_dict(tracker.state_dict())
    line = restored.final_message(20, tmp_path / "final", None)
    assert "prompt lookup, which needs no training, 1.250 on the same samples: the drafter reads 2.40x it" in line
    assert "4.500 as the mean of the samples' own taus (pooled: tokens over cycles)" in line
    plain = HeldoutTracker()
    plain.observe(10, {"tau": 2.5})  # a cache evaluated without the lookup figure: nothing said of it
    assert "prompt lookup" not in plain.final_message(10, tmp_path / "final", None)


def test_no_verdict_on_the_trend_before_the_run_has_evaluated_a_few_times():
    from dflash.train.measure.reporting import MIN_EVALS_FOR_VERDICT, PATIENCE, HeldoutTracker

    tracker = HeldoutTracker()
    records = []
    for step, tau in enumerate([2.0, 1.9, 1.8, 1.7, 1.6], start=1):
        tracker.add_train({"tau": 1.0 + step, "blocks": 10})  # training tau keeps rising
        records.append(tracker.observe(step, {"tau": tau}))
    assert PATIENCE < MIN_EVALS_FOR_VERDICT
    assert not any("warning" in r for r in records[:MIN_EVALS_FOR_VERDICT - 1])
    warned = [r["warning"] for r in records[MIN_EVALS_FOR_VERDICT - 1:]]
    assert [w.code for w in warned] == ["train.heldout-overfitting"] * len(warned)
    first = MIN_EVALS_FOR_VERDICT - 1  # the evaluation at step MIN_EVALS_FOR_VERDICT, tau 2.0 - 0.1 * first
    assert warned[0].fields == {"tau": pytest.approx(2.0 - 0.1 * first), "best_tau": 2.0, "best_step": 1,
                                "evaluations": first, "best_train_tau": 2.0,
                                "train_tau": 2.0 + first, "flag": "--epochs"}  # the flag that stops it earlier


def test_a_heldout_tau_that_stalls_while_training_tau_does_not_rise_is_told_apart_from_overfitting(tmp_path):
    from dflash.train.measure.reporting import MIN_EVALS_FOR_VERDICT, HeldoutTracker, RunLogger

    tracker = HeldoutTracker()
    records = []
    for step in range(1, MIN_EVALS_FOR_VERDICT + 1):
        tracker.add_train({"tau": 3.0, "blocks": 10})  # training tau flat
        records.append(tracker.observe(step, {"tau": 2.0 if step == 1 else 1.5}))
    warning = records[-1]["warning"]
    assert warning.code == "train.heldout-stalled"
    assert warning.fields == {"tau": 1.5, "best_tau": 2.0, "best_step": 1, "evaluations": MIN_EVALS_FOR_VERDICT - 1}
    # metrics.jsonl keeps the warning's text under `warning` and adds its code
    log = RunLogger(tmp_path, enabled=True, progress=False, tensorboard=False)
    log.log(MIN_EVALS_FOR_VERDICT, "eval", records[-1])
    [written] = read_metrics(tmp_path)
    assert written["warning"] == str(warning) and written["warning_code"] == "train.heldout-stalled"

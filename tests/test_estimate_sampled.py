"""The held-out estimate on sampled completions: the target's stored top-1 makes the walk the
greedy decoder's (docs/train.md, "Estimator")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_target, tiny_train_config
from dflash.cache_tools.manifest import read_manifest
from dflash.eval.lookup import lookup_generate
from dflash.eval.run import load_models
from dflash.eval.speculative import DecodeConfig, speculative_generate, target_generate
from dflash.train.loss.objective import LossOutput
from dflash.train.measure.estimate import estimate_drafter
from dflash.train.measure.metrics import MIN_GREEDY_SAMPLES, VerificationWalk, walk_interval
from dflash.train.run.loop import train
from extract_utils import extract

VOCAB, PROMPT, NEW, BLOCK = 48, 8, 40, 8


def blocks(leading: list[int], anchors: list[int], slots: int) -> LossOutput:
    a, n = torch.tensor([anchors]), torch.tensor([leading])
    valid = torch.ones(1, len(anchors), slots, dtype=torch.bool)
    return LossOutput(loss=torch.zeros(()), ce=torch.zeros(()), kl=None,
                      correct=torch.arange(slots)[None, None, :] < n[..., None], valid=valid,
                      anchor_positions=a, anchor_valid=torch.ones(a.shape, dtype=torch.bool))


def test_a_block_accepted_past_a_sampled_token_is_censored_there():
    # Anchors 0..9, blocks of 4 (3 drafts), every draft right by the replayed check. Token 6 is
    # sampled (not the target's top-1 after tokens 0..5). The block at 0 is whole (its checks
    # follow tokens 0..3, all on the path): 4 tokens. The block at 4 knows drafts 1 and 2 (after
    # tokens ..4 and ..5); its draft 3 would follow the decoder's own token 6, which the cache
    # does not hold: censored with 2 accepted, and the walk goes on at the sampled token 6. The
    # block at 6 is whole again: 4 tokens, then past the anchors.
    eligible = torch.zeros(1, 14, dtype=torch.bool)
    eligible[0, :10] = True
    on_path = torch.ones(1, 14, dtype=torch.bool)
    on_path[0, 6] = False
    walk = VerificationWalk((4,))
    walk.update([blocks([3] * 10, list(range(10)), 3)], eligible, on_path)
    counts = walk.others  # 1 of its 10 next tokens off the path: a sampled completion
    assert counts.cycles == [3] and counts.censored == [1] and walk.greedy.samples == 0
    # Kaplan-Meier: no draft was ever rejected, so tau is the whole block, 4 (counting the censored
    # block as a rejection would say 11 / 3).
    assert walk.taus(walk.state()) == {4: pytest.approx(4.0)}
    assert walk.walked(walk.state()) == {"walked_samples": 1, "greedy_samples": 0, "censored_blocks": 1 / 3}
    # Without the target's top-1 the samples are the path: 0 -> 4 -> 8, all whole.
    plain = VerificationWalk((4,))
    plain.update([blocks([3] * 10, list(range(10)), 3)], eligible)
    assert plain.taus(plain.state()) == {4: 4.0} and plain.greedy.censored == [0]


def test_kaplan_meier_counts_censored_blocks_as_reaching_their_known_drafts():
    walk = VerificationWalk((4,))
    for accepted, censored in [(0, False), (2, False), (1, True), (3, False)]:
        walk.others.count(0, accepted, censored)
    walk.others.samples = 1
    # Draft 1: 4 blocks reach it, 1 rejects it: S1 = 3/4. Draft 2: 2 reach it with it known (the
    # censored block knew draft 1 only), none rejects: S2 = 3/4. Draft 3: 2 reach it, 1 rejects:
    # S3 = 3/8. tau = 1 + S1 + S2 + S3.
    assert walk.taus(walk.state())[4] == pytest.approx(1 + 0.75 + 0.75 + 0.375)


def _complete(model, prompts: list[list[int]], temperature: float, seed: int, steps: int = NEW) -> list[list[int]]:
    ids, gen = torch.tensor(prompts), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids).logits[:, -1].float()
            nxt = (torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen) if temperature
                   else logits.argmax(-1, keepdim=True))
            ids = torch.cat([ids, nxt], 1)
    return ids.tolist()


def _write(path: Path, rows: list[list[int]]) -> Path:
    path.mkdir()
    with open(path / "data.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r, "loss_mask": [0] * PROMPT + [1] * (len(r) - PROMPT)}) + "\n")
    return path


def _clipped_sums(acceptance: list[list[int]]) -> list[tuple[int, int]]:
    """Per prompt, the decoder's tokens and cycles, its last cycle's drafts cut at the
    completion's end (the first new token is the prefill's): what a walk over it counts."""
    sums = []
    for lengths in acceptance:
        tokens = cycles = 0
        left = NEW - 1  # tokens after the first anchor
        for a in lengths:
            if left <= 0:
                break
            drafts = min(a - 1, left)
            tokens, cycles, left = tokens + drafts + 1, cycles + 1, left - drafts - 1
        sums.append((tokens, cycles))
    return sums


def _clipped_tau(acceptance: list[list[int]]) -> float:
    sums = _clipped_sums(acceptance)
    return sum(t for t, _ in sums) / sum(c for _, c in sums)


def test_estimate_on_sampled_completions_follows_the_greedy_decode(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = make_tiny_target(tmp_path / "target", hidden=32, layers=4, vocab=VOCAB, heads=2, kv_heads=1)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # a confident target: sampled tokens are often its top-1, not always
    model.save_pretrained(str(target))
    gen = torch.Generator().manual_seed(0)
    train_prompts = torch.randint(0, VOCAB, (128, PROMPT), generator=gen).tolist()
    rows = _complete(model, train_prompts[:64], 0.0, 1) + _complete(model, train_prompts[64:], 1.0, 2)
    prompts = torch.randint(0, VOCAB, (16, PROMPT), generator=gen).tolist()
    greedy_rows, sampled_rows = _complete(model, prompts, 0.0, 3), _complete(model, prompts, 1.0, 4)
    assert sum(a != b for g, s in zip(greedy_rows, sampled_rows) for a, b in zip(g, s)) > 16 * NEW // 4
    caches = {}
    # greedy completions with one token that is not the target's top-1 (as a bf16 near tie gives),
    # greedy again after it
    cut = PROMPT + NEW // 2
    near_rows = _complete(model, [r[:cut] + [(r[cut] + 1) % VOCAB] for r in greedy_rows], 0.0, 5, NEW - NEW // 2 - 1)
    for name, data in (("train", rows), ("greedy", greedy_rows), ("sampled", sampled_rows),
                       ("mixed", greedy_rows[:8] + sampled_rows[8:]), ("near", near_rows)):
        caches[name] = tmp_path / f"{name}-cache"
        # caches used whole by the estimate: the target's top-1 for every sample (--top1-share 1)
        extract(target, _write(tmp_path / name, data), caches[name], max_seq_len=64, top1_share=1.0)
    extract(target, tmp_path / "sampled", tmp_path / "labels-cache", max_seq_len=64, store_top1=False, store_topk=0)
    assert read_manifest(caches["train"]).top1 == "uint16" and read_manifest(tmp_path / "labels-cache").top1 is None

    run = tmp_path / "run"
    train(tiny_train_config(caches["train"], target, run, block_size=BLOCK, max_anchors=16, epochs=5, lr=3e-3,
                            eval_fraction=0.0, max_seq_len=64, token_budget=512, max_batch_size=16, dtype="fp32",
                            log_interval=1000))
    target_model, drafter, _ = load_models(str(target), str(run / "final"), "cpu", torch.float32)
    decoded = speculative_generate(target_model, drafter, prompts, DecodeConfig(max_new_tokens=NEW, block_size=BLOCK))
    baseline = target_generate(target_model, prompts, DecodeConfig(max_new_tokens=NEW))
    assert [g.tokens for g in decoded] == [g.tokens for g in baseline] == [r[PROMPT:] for r in greedy_rows]
    tau = _clipped_tau([g.acceptance_lengths for g in decoded])
    assert tau > 1.5  # a drafter that drafts: the figures below compare something

    settings = dict(target_model=str(target), max_anchors=64, token_budget=512, max_batch_size=16, max_seq_len=64,
                    num_workers=0, device="cpu", dtype="fp32")

    def estimate(cache: Path) -> dict:
        return estimate_drafter(str(run / "final"), {**settings, "cache": [str(cache)]})

    # On the greedy completions of the decoded prompts the walk is the decoder, cycle for cycle.
    greedy = estimate(caches["greedy"])
    assert greedy["estimator"] == "greedy walk" and greedy["censored_blocks"] == 0
    assert greedy["tau"] == pytest.approx(tau, rel=1e-9)
    # Half of them sampled: the estimate is the greedy half's walk (their own prompts).
    mixed = estimate(caches["mixed"])
    assert mixed["greedy_samples"] == 8 and mixed["walked_samples"] == 16
    assert mixed["tau"] == pytest.approx(_clipped_tau([g.acceptance_lengths for g in decoded[:8]]), rel=1e-9)
    # Prompt lookup beside it, replayed on the same samples: dflash-eval's lookup decode of those
    # prompts, cycle for cycle (all 16, then the greedy 8 the mixed estimate reads).
    looked = lookup_generate(target_model, prompts, DecodeConfig(max_new_tokens=NEW, block_size=BLOCK))
    assert [g.tokens for g in looked] == [r[PROMPT:] for r in greedy_rows]
    lookup = _clipped_tau([g.acceptance_lengths for g in looked])
    assert 1.0 < lookup < tau  # it accepts something, less than the trained drafter
    assert greedy["tau_lookup"] == pytest.approx(lookup, rel=1e-12)
    # The per-sample mean beside the pooled tau: dflash-eval's per-prompt mean of the same decode.
    sums = _clipped_sums([g.acceptance_lengths for g in decoded])
    assert greedy["tau_per_sample_mean"] == pytest.approx(sum(t / c for t, c in sums) / len(sums), rel=1e-12)
    assert greedy["tau_per_sample_mean"] != pytest.approx(greedy["tau"], rel=1e-3)  # the two differ here
    assert mixed["tau_lookup"] == pytest.approx(_clipped_tau([g.acceptance_lengths for g in looked[:8]]), rel=1e-12)
    # A greedy completion with a censored block (its last token off the path) is still greedy text:
    # the lookup and the per-sample mean stay beside the estimate (they went missing on every real
    # run, whose bf16 extraction disagrees with the decoder at a near tie now and then).
    near = estimate(caches["near"])
    assert near["greedy_samples"] == 16 and near["censored_blocks"] > 0
    assert 1.0 < near["tau_lookup"] < near["tau"] and 1.0 < near["tau_per_sample_mean"] < BLOCK
    # The estimate's 95 % interval resamples the samples it reads: the decoded prompts' own
    # figures (all 16, then the greedy 8 alone), whatever order the cache stores them in.
    for result, first in ((greedy, 16), (mixed, 8)):
        sums = _clipped_sums([g.acceptance_lengths for g in decoded[:first]])
        lo, hi = result["tau_interval"]
        assert lo < result["tau"] < hi
        assert [lo, hi] == pytest.approx(walk_interval([[1.0, t, c] for t, c in sums], result["tau"]), rel=1e-12)
    # All sampled: censored at the sampled tokens, far nearer the decode than checking the drafts
    # against the sampled tokens (what a cache without the top-1 gives).
    sampled, labels = estimate(caches["sampled"]), estimate(tmp_path / "labels-cache")
    assert sampled["greedy_samples"] == 0 and sampled["censored_blocks"] > 0
    assert "tau_lookup" not in sampled and "tau_per_sample_mean" not in sampled  # no like for like there
    assert labels["estimator"] == "labels walk"
    print(f"decoded {tau:.3f}, sampled estimate {sampled['tau']:.3f}, labels {labels['tau']:.3f}")
    assert labels["tau"] < tau and abs(sampled["tau"] - tau) < abs(labels["tau"] - tau)


def test_the_interval_reads_what_the_estimate_reads_and_narrows_with_more_samples():
    """Greedy completions alone when there are MIN_GREEDY_SAMPLES of them (as the estimate), else
    every walked sample; wider for fewer samples; none for fewer than two."""
    rng = np.random.default_rng(0)

    def rows(n: int, greedy: float, tau: float) -> list[list[float]]:
        cycles = rng.integers(10, 40, n)
        return [[greedy, float(round(c * tau * rng.uniform(0.6, 1.4))), float(c)] for c in cycles]

    greedy, sampled = rows(MIN_GREEDY_SAMPLES, 1.0, 4.0), rows(40, 0.0, 1.5)
    lo, hi = walk_interval(greedy + sampled, 4.0)
    assert 3.0 < lo < 4.0 < hi < 5.0  # the greedy ones' alone, not pulled towards 1.5
    lo, hi = walk_interval(greedy[:-1] + sampled, 1.7)
    assert lo < 1.7 < hi < 2.5  # too few greedy ones: everything walked
    few, many = rows(10, 1.0, 3.0), rows(400, 1.0, 3.0)
    width = [(lambda s: s[1] - s[0])(walk_interval(r, 3.0)) for r in (few, many)]
    assert width[1] < 0.4 * width[0]
    assert walk_interval(few[:1], 3.0) == [] and walk_interval(few[::-1], 3.0) == walk_interval(few, 3.0)


def test_the_interval_resamples_whole_groups_and_is_the_per_sample_one_when_each_sample_is_its_own():
    """Samples of one document move together: 4 documents of 10 samples each, their tau 2, 3, 4
    and 5, are 4 draws, not 40, and the interval says so; with every sample its own cluster the
    clustered interval is the per-sample one."""
    rows = [[1.0, 40.0 * t, 40.0, 0.0] for t in (2, 3, 4, 5) for _ in range(10)]
    for doc, row in enumerate(rows):
        row[3] = float(doc // 10)
    tau = sum(r[1] for r in rows) / sum(r[2] for r in rows)
    samples = walk_interval([r[:3] for r in rows], tau)
    groups = walk_interval(rows, tau)
    assert groups[0] < samples[0] < tau < samples[1] < groups[1]
    assert groups[1] - groups[0] > 2 * (samples[1] - samples[0])
    singletons = [[*r[:3], float(i)] for i, r in enumerate(rows)]
    assert walk_interval(singletons, tau) == samples
    assert walk_interval([rows[0], rows[1]], tau) == []  # two samples of one document: one draw

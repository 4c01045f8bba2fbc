"""Prompt lookup and the target's confidence beside the held-out estimate: the evaluation walks
lookup along the held-out samples' text and along the training samples', reads the target's
top-1 probability over both, and a run's startup and last line say when the held-out documents
are unlike the rest (a split of few documents that drew easy or hard ones)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_train_config
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.sample_scores import heldout_scores
from dflash.runtime.findings import collected
from dflash.runtime.lookup import lookup_walk
from dflash.train.data.loader import sample_tensors
from dflash.train.run.loop import train
from test_record_groups import group_key
from test_split_keys import extract_records
from test_target_families import VOCAB

GROUPS, PER_GROUP, FRACTION, BLOCK = 12, 4, 0.3, 4


def records(repetitive_groups: set[int]) -> list[dict]:
    """GROUPS documents of PER_GROUP records; the answers of `repetitive_groups` repeat a short
    phrase (text prompt lookup drafts well), the others are random tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(GROUPS * PER_GROUP):
        group = k % GROUPS
        prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
        if group in repetitive_groups:
            phrase = torch.randint(0, VOCAB, (3,), generator=g).tolist()
            answer = (phrase * 6)[:16]
        else:
            answer = torch.randint(0, VOCAB, (16,), generator=g).tolist()
        out.append({"group": f"doc-{group}", "input_ids": prompt + answer, "loss_mask": [0] * 6 + [1] * 16})
    return out


def heldout_groups() -> set[int]:
    """The groups the split holds out at FRACTION, by the split's own hash of their keys."""
    keys = np.array([group_key(f"doc-{k}") for k in range(GROUPS)], dtype=np.int64)
    return set(np.flatnonzero(heldout_scores(keys) < FRACTION).tolist())


def walk(record: dict) -> tuple[int, int]:
    mask = np.array(record["loss_mask"], dtype=bool)
    return lookup_walk(record["input_ids"], np.flatnonzero(mask[:-1] & mask[1:]), BLOCK, scored=mask)


def run(tmp_path, name: str, repetitive: set[int], capsys, *extract_args: str
        ) -> tuple[dict, str, list[dict], list]:
    """(the last evaluation's record, the run's last line, the records in cache order, the
    startup's findings that the held-out samples are unlike the rest)."""
    data = extract_records(tmp_path / name, records(repetitive), *extract_args)
    with collected() as found:
        train(tiny_train_config(data["cache"], data["target"], tmp_path / name / "run", block_size=BLOCK,
                                eval_fraction=FRACTION, eval_interval=2, max_steps=2, save_interval=2))
    evals = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    lines = capsys.readouterr().out.splitlines()
    last = [line for line in lines if line.startswith("done: ")][-1]
    notes = [f for f in found if f.code.startswith("train.heldout-unlike-")]
    ids = CacheSet([str(data["cache"])], max_seq_len=64).sample_ids()  # cache order -> record index
    return [r for r in evals if r.get("kind") == "eval"][-1], last, [data["records"][i] for i in ids], notes


def pooled(walks: list[tuple[int, int]]) -> float:
    return sum(t for t, _ in walks) / sum(c for _, c in walks)


def test_a_split_that_drew_repetitive_documents_is_said_to_be_unlike_the_rest(tmp_path, capsys):
    held = heldout_groups()
    assert 0 < len(held) < GROUPS  # the split holds out some documents, not all
    # without top-k log-probs (no confidence figure), the text is what the trainer has to go on
    record, last, ordered, notes = run(tmp_path, "unlike", held, capsys, "--store-topk", "0")
    in_held = [int(r["group"][4:]) in held for r in ordered]
    # Both figures are prompt lookup's walk along the samples' own tokens: every held-out sample,
    # and every training one (fewer than the TEXT_SAMPLES the evaluation draws).
    assert record["lookup_text_heldout"] == pooled([walk(r) for r, h in zip(ordered, in_held) if h])
    assert record["lookup_text_training"] == pooled([walk(r) for r, h in zip(ordered, in_held) if not h])
    assert record["lookup_text_training_samples"] == sum(not h for h in in_held)
    assert record["lookup_text_heldout"] > 1.5 * record["lookup_text_training"]
    assert "confidence_heldout" not in record
    assert "The held-out text repeats itself more than the training text" in last
    assert f"{record['lookup_text_heldout']:.3f} along the held-out samples" in last
    # no direction: on the benchmark's code a split of less repetitive text read high
    assert "can read high or low" in last and "likely reads" not in last
    # The startup says so before any step, with the same figures, while the flags can still change.
    [note] = notes
    assert note.code == "train.heldout-unlike-text" and note.fields["ahead"] is True
    assert f"{note.fields['held']:.3f}" == f"{record['lookup_text_heldout']:.3f}"
    assert note.fields["said_to_measure"] is False  # so its paragraph gives the fix (--eval-fraction)


def test_a_split_the_target_is_surer_of_is_said_to_read_high_with_the_corrected_figure(tmp_path, capsys,
                                                                                       monkeypatch):
    from dflash.train.measure import reporting

    held = heldout_groups()
    # the tiny target's confidences differ by chance, not by much: no threshold leaves them alike
    monkeypatch.setattr(reporting, "UNLIKE_CONFIDENCE", 0.0)
    record, last, _, notes = run(tmp_path, "surer", held, capsys)
    ratio = record["confidence_heldout"] / record["confidence_training"]
    assert ratio != 1.0
    high = ratio > 1
    figures = (f"{record['confidence_heldout']:.3f} over the held-out samples and "
               f"{record['confidence_training']:.3f} over {record['confidence_training_samples']} training samples")
    assert figures in last and ("likely reads high" if high else "likely reads low") in last
    assert ("surer" if high else "less sure") in last
    # the text figure is not the note's when the confidence is there (it pointed the wrong way on code)
    assert "repeats itself" not in last
    [note] = notes
    assert note.code == "train.heldout-unlike-confidence" and note.fields["ahead"] is True
    shown = {k: f"{note.fields[k]:.3f}" for k in ("held", "training")}
    assert shown == {"held": f"{record['confidence_heldout']:.3f}", "training": f"{record['confidence_training']:.3f}"}
    assert note.fields["samples"] == record["confidence_training_samples"]


def test_the_note_on_unlike_samples_says_the_confidence_s_direction_and_the_text_s_none():
    from dflash.train.measure.reporting import unlike_heldout, unlike_heldout_finding

    found = unlike_heldout_finding([1.7, 2.0, 512], [0.850, 0.804, 512], 7.22)
    assert (found.code, found.fields) == ("train.heldout-unlike-confidence", dict(
        held=0.850, training=0.804, samples=512, adjusted=7.22, ahead=False, said_to_measure=False))
    assert unlike_heldout_finding([1.2, 2.0, 512], None).code == "train.heldout-unlike-text"
    assert unlike_heldout_finding([1.2, 2.0, 512], [0.81, 0.804, 512]) is None
    # the renderers' words: the confidence's direction, the text's none

    surer = unlike_heldout([1.7, 2.0, 512], [0.850, 0.804, 512], 7.22)
    assert "surer" in surer and "likely reads high" in surer and "reads 7.220" in surer and "+5.7 %" in surer
    assert "repeats itself" not in surer and "--eval-fraction" in surer
    assert "likely reads low" in unlike_heldout(None, [0.78, 0.804, 512])
    assert "will likely read low" in unlike_heldout(None, [0.78, 0.804, 512], ahead=True)
    assert unlike_heldout([1.2, 2.0, 512], [0.81, 0.804, 512]) == ""  # sure alike: the text is not said
    text = unlike_heldout([1.2, 2.0, 512], None, said_to_measure=True)
    assert "repeats itself less" in text and "can read high or low" in text and "--eval-fraction" not in text
    assert unlike_heldout([2.1, 2.0, 512], None) == "" and unlike_heldout(None, None) == ""


def confidence(caches: CacheSet, indices: list[int]) -> float:
    """The target's top-1 probability averaged over the loss tokens of `indices`, read whole."""
    samples = [sample_tensors(caches.read(i)) for i in indices]
    probs = [s["topk_logprobs"][:, 0].exp()[s["loss_mask"].bool()] for s in samples]
    return float(torch.cat(probs).double().mean())


def test_the_target_s_confidence_in_the_heldout_text_stands_beside_the_training_texts(tmp_path, capsys):
    held = heldout_groups()
    record, _, ordered, _ = run(tmp_path, "sure", held, capsys)
    caches = CacheSet([str(tmp_path / "sure" / "cache")], max_seq_len=64)
    in_held = [int(r["group"][4:]) in held for r in ordered]
    # every held-out sample (all walked), and every training one (fewer than TEXT_SAMPLES)
    assert record["confidence_heldout"] == pytest.approx(confidence(caches, [i for i, h in enumerate(in_held) if h]))
    assert record["confidence_training"] == pytest.approx(
        confidence(caches, [i for i, h in enumerate(in_held) if not h]))
    assert "tau_confidence_adjusted" not in record  # a censored walk (random answers): no regression figure
    # dflash-train estimate of the exported drafter over the whole cache says it too
    from dflash.train.measure.estimate import estimate_drafter, format_estimate

    estimate = estimate_drafter(str(tmp_path / "sure" / "run" / "final"), {
        "cache": [str(tmp_path / "sure" / "cache")], "target_model": str(tmp_path / "sure" / "target"),
        "num_workers": 0, "block_size": BLOCK})
    assert estimate["confidence_heldout"] == pytest.approx(confidence(caches, list(range(len(caches)))))
    assert f"the target's mean top-1 probability {estimate['confidence_heldout']:.3f}" in format_estimate(estimate)


def test_the_regression_estimate_moves_the_split_to_the_training_samples_mean_of_any_figure():
    from dflash.train.measure.evaluation import regression_adjusted_tau

    # Twelve greedy samples whose drafter cycles a token are exactly 0.9 - 0.6 p, p the target's
    # mean top-1 probability: at the training samples' mean p the estimate is 1 / (0.9 - 0.6 p).
    sure = np.linspace(0.5, 0.95, 12)
    per_sample = [[1.0, 100.0, 100.0 * (0.9 - 0.6 * p), 7.0] for p in sure]
    aux = [[p] for p in sure]
    assert regression_adjusted_tau(per_sample, aux, sure.mean(), 0.6, 16) == pytest.approx(1 / (0.9 - 0.36))
    raw = sum(r[1] for r in per_sample) / sum(r[2] for r in per_sample)
    assert regression_adjusted_tau(per_sample, aux, sure.mean(), sure.mean(), 16) == pytest.approx(raw)
    # a sample without the figure (NaN) is left out of the fit; too few left: no figure
    assert regression_adjusted_tau(per_sample, aux[:-1] + [[float("nan")]], sure[:-1].mean(), 0.6, 16) is not None
    assert regression_adjusted_tau(per_sample, [[float("nan")]] * 12, 0.7, 0.6, 16) is None


def test_reading_the_top1_log_probs_alone_gives_each_samples_rows_across_parts(tmp_path):
    data = extract_records(tmp_path, records(set()))
    caches = CacheSet([str(data["cache"])], max_seq_len=20)
    assert len(caches.readers[0].parts) > 1
    order = [5, 0, len(caches) - 1, 3, 4]
    for index, (logprobs, mask) in zip(order, caches.read_top1_logprobs(order), strict=True):
        whole = sample_tensors(caches.read(index))
        assert logprobs.dtype == np.float32 and len(logprobs) == 20
        assert logprobs.tolist() == whole["topk_logprobs"][:, 0].tolist()
        assert mask.tolist() == whole["loss_mask"].bool().tolist()


def test_a_split_like_the_rest_says_nothing_of_its_text(tmp_path, capsys):
    from dflash.train.measure.reporting import UNLIKE_CONFIDENCE

    record, last, _, notes = run(tmp_path, "alike", set(), capsys)
    ratio = record["lookup_text_heldout"] / record["lookup_text_training"]
    assert 1 / 1.1 <= ratio <= 1.1
    assert "repeats itself" not in last
    # (the tiny target's confidence in either set differs by chance: said when it passes the threshold)
    sure = record["confidence_heldout"] / record["confidence_training"]
    said = not 1 / (1 + UNLIKE_CONFIDENCE) <= sure <= 1 + UNLIKE_CONFIDENCE
    assert [n.startswith("Note: The target is") for n in notes] == ([True] if said else [])
    # Its random answers are not the target's greedy ones: the estimate is a censored walk, which
    # a lookup walk along the sampled tokens would not match, so the line sets no lookup beside it.
    assert record["censored_blocks"] > 0 and "tau_lookup" not in record and "prompt lookup, which" not in last


def test_the_text_adjusted_estimate_moves_the_split_to_the_training_texts_repetitiveness():
    from dflash.train.measure.evaluation import text_adjusted_tau

    # Twelve greedy samples of 100 tokens whose drafter cycles a token are exactly 0.1 + 0.5 x
    # their prompt lookup's x: the regression estimator is then exact for any text, so at the
    # training text's lookup rate it gives 0.1 + 0.5 * (1 / training text's lookup tau).
    lookup_rates = np.linspace(0.3, 0.9, 12)
    per_sample = [[1.0, 100.0, 100.0 * (0.1 + 0.5 * x), 7.0] for x in lookup_rates]
    lookups = [[100.0, 100.0 * x] for x in lookup_rates]
    heldout_text = 1 / lookup_rates.mean()
    assert text_adjusted_tau(per_sample, lookups, heldout_text, 1.25, 16) == pytest.approx(1 / (0.1 + 0.5 / 1.25))
    # Held-out text as repetitive as the training text: the estimate as it is.
    raw = sum(r[1] for r in per_sample) / sum(r[2] for r in per_sample)
    assert text_adjusted_tau(per_sample, lookups, heldout_text, heldout_text, 16) == pytest.approx(raw)
    # Sampled rows are not read while greedy ones suffice; too few rows, or no spread: no figure.
    sampled = [[0.0, 100.0, 100.0, 7.0]] * 5
    assert text_adjusted_tau(per_sample + sampled, lookups + [[100.0, 50.0]] * 5, heldout_text, 1.25, 16) == \
        pytest.approx(1 / (0.1 + 0.5 / 1.25))
    assert text_adjusted_tau(per_sample[:5], lookups[:5], heldout_text, 1.25, 16) is None
    assert text_adjusted_tau(per_sample, [[100.0, 50.0]] * 12, 2.0, 1.25, 16) is None


def test_reading_the_ids_alone_gives_each_samples_tokens_and_mask_across_parts(tmp_path):
    data = extract_records(tmp_path, records(set()))
    caches = CacheSet([str(data["cache"])], max_seq_len=20)  # shorter than the samples: cut as read() cuts
    assert len(caches.readers[0].parts) > 1
    order = [5, 0, len(caches) - 1, 3, 4]  # any order, parts revisited
    for index, (ids, mask) in zip(order, caches.read_ids(order), strict=True):
        whole = sample_tensors(caches.read(index))
        assert ids.dtype == np.int64 and mask.dtype == bool and len(ids) == 20
        assert ids.tolist() == whole["input_ids"].tolist() and mask.tolist() == whole["loss_mask"].bool().tolist()

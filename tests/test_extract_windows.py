"""Sort windows: records -> length-sorted windows -> parts -> batches, with little padding."""

from __future__ import annotations

import json
import random

from dflash.extract.batching import make_batches
from dflash.extract.buffers import PartGroup
from dflash.extract.data import PartRules, plan_windows


def write_lengths(path, lengths, bad_at=()):
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            if i in bad_at:
                f.write("{not json\n")
            else:
                f.write(json.dumps({"input_ids": [1] * n, "prompt_len": 0}) + "\n")
    return path


def plan_parts(files, rules):
    return [part for parts in plan_windows(files, rules) for part in parts]


def rules(part_tokens, window_tokens, **kw):
    return PartRules(vocab_size=10, max_seq_len=10_000, long_samples="truncate", skip_bad=True,
                     part_tokens=part_tokens, window_tokens=window_tokens, **kw)


def test_windows_are_sorted_longest_first_and_cut_into_parts_in_order(tmp_path):
    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(300)]
    plans = list(plan_parts([write_lengths(tmp_path / "d.jsonl", lengths)], rules(1000, 8000)))
    ids = [s.sample_id for p in plans for s in p.samples]
    assert sorted(ids) == list(range(300))  # every record once
    assert [p.index for p in plans] == list(range(len(plans)))
    windows: dict[int, list] = {}
    for p in plans:
        assert p.num_tokens <= 1000
        windows.setdefault(p.window, []).append(p)
    assert len(windows) > 3
    previous_last = -1
    for w in sorted(windows):
        samples = [s for p in windows[w] for s in p.samples]
        assert sum(s.length for s in samples) <= 8000
        got = [s.length for s in samples]
        assert got == sorted(got, reverse=True)  # the window's parts hold it in sorted order
        records = sorted(s.sample_id for s in samples)
        assert records == list(range(previous_last + 1, previous_last + 1 + len(records)))  # consecutive records
        previous_last = records[-1]


def test_a_window_sorts_away_most_of_the_padding(tmp_path):
    rng = random.Random(1)
    lengths = [rng.randint(1536, 2560) for _ in range(512)]
    data = write_lengths(tmp_path / "d.jsonl", lengths)

    def padding(window_tokens):
        padded = real = 0
        for w in {p.window for p in plans(window_tokens)}:
            samples = [s for p in plans(window_tokens) if p.window == w for s in p.samples]
            for b in make_batches(samples, 32768):
                padded += b.padded_tokens
                real += b.real_tokens
        return 1 - real / padded

    cache: dict[int, list] = {}

    def plans(window_tokens):
        if window_tokens not in cache:
            cache[window_tokens] = list(plan_parts([data], rules(32768, window_tokens)))
        return cache[window_tokens]

    alone, window = padding(0), padding(16 * 32768)
    assert alone > 0.05  # each 32K-token part batched alone
    assert window < alone / 4, (alone, window)


def test_skips_are_counted_in_the_first_part_of_their_window(tmp_path):
    data = write_lengths(tmp_path / "d.jsonl", [50] * 10, bad_at=(1, 9))
    plans = list(plan_parts([data], rules(100, 200)))
    assert sum(p.stats["records"] for p in plans) == 10
    # records 0,2,3 -> window 0 (line 2 is bad); ...; the trailing bad line goes to the last window
    first_of = {}
    for p in plans:
        first_of.setdefault(p.window, p)
    skipped = {p.index: [s["sample_id"] for s in p.stats["skips"]] for p in plans if p.stats["skips"]}
    assert skipped[first_of[0].index] == [1]
    assert skipped[first_of[max(first_of)].index] == [9]


def test_batches_open_the_window_parts_one_after_the_other(tmp_path):
    rng = random.Random(2)
    lengths = [rng.randint(10, 120) for _ in range(200)]
    plans = [p for p in plan_parts([write_lengths(tmp_path / "d.jsonl", lengths)], rules(400, 100_000))]
    group = PartGroup(plans, [True] * len(plans))
    opened: list[str] = []
    open_now: set[str] = set()
    most_open = 0
    for batch in make_batches(group.samples, 256):
        for buf in group.open(batch.members, lambda plan: FakeBuffer(plan)):
            opened.append(buf.plan.name)
            open_now.add(buf.plan.name)
        for buf in group.mark_filled(batch.members):
            open_now.discard(buf.plan.name)
        most_open = max(most_open, len(open_now))
    assert opened == [p.name for p in plans]  # in part order, each once
    assert not open_now  # every part completed
    assert most_open <= 2  # a batch spans the end of one part and the start of the next


class FakeBuffer:
    pinned = True

    def __init__(self, plan):
        self.plan = plan
        self.filled = 0

    def mark_filled(self, n):
        self.filled += n

    @property
    def complete(self):
        return self.filled == len(self.plan.samples)

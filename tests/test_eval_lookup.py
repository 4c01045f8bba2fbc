"""Prompt lookup: the n-gram proposer on hand-made texts, and lossless decoding under verification."""

from __future__ import annotations

import pytest
import torch
from dflash.eval.lookup import LookupProposer, lookup_generate, lookup_proposal
from dflash.eval.speculative import DecodeConfig, acceptance_summary, target_generate
from test_eval_support import PERIOD, VOCAB, CountingTarget, periodic_ids, tiny_target


def test_the_longest_suffix_match_proposes_the_tokens_that_followed_it():
    text = [5, 1, 2, 3, 4, 9, 8, 7, 6, 1, 2, 3, 4, 10, 11, 1, 2, 3, 4]
    # The 4-gram [1, 2, 3, 4] occurs at 1 and 9: the latest with 3 tokens after it is at 9.
    assert lookup_proposal(text, 3) == [10, 11, 1]
    # 6 tokens follow the one at 9 too (up to the end of the text).
    assert lookup_proposal(text, 6) == [10, 11, 1, 2, 3, 4]
    # 8 tokens follow neither: the earliest occurrence, which has the most after it.
    assert lookup_proposal(text, 8) == [9, 8, 7, 6, 1, 2, 3, 4]


def test_shorter_ngrams_are_tried_when_longer_ones_do_not_occur():
    # [7, 2, 3] and [9, 7, 2, 3] occur nowhere else, [2, 3] does: what followed it is proposed.
    assert lookup_proposal([1, 2, 3, 9, 7, 2, 3], 4) == [9, 7, 2, 3]
    # The longest match wins over a later shorter one: [5, 6, 7] at 0 beats [6, 7] at 4.
    assert lookup_proposal([5, 6, 7, 1, 6, 7, 2, 5, 6, 7], 2) == [1, 6]
    # max_ngram bounds the match: with n <= 2, [6, 7] at 4 is the latest occurrence.
    assert lookup_proposal([5, 6, 7, 1, 6, 7, 2, 5, 6, 7], 2, max_ngram=2) == [2, 5]
    # min_ngram: a lone repeated token is not enough with min_ngram=2.
    assert lookup_proposal([4, 8, 1, 4], 3) == [8, 1, 4]
    assert lookup_proposal([4, 8, 1, 4], 3, min_ngram=2) == []


def test_no_repetition_or_a_single_token_proposes_nothing():
    assert lookup_proposal([1, 2, 3, 4], 5) == []
    assert lookup_proposal([7], 5) == []
    with pytest.raises(ValueError, match="max_tokens"):
        lookup_proposal([1, 2], 0)


def test_proposals_of_a_batch_are_padded_and_their_lengths_given():
    proposer = LookupProposer(block_size=4, filler_id=0)
    drafts, lengths = proposer.propose(torch.tensor([3, 9]), torch.tensor([0, 0]), [([1, 2, 3, 1, 2], [3]), ([9], [])])
    assert drafts.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert lengths.tolist() == [3, 0]
    drafts, lengths = proposer.propose(torch.tensor([9]), torch.tensor([0]), [([1, 2], [9])])
    assert drafts.shape == (1, 0) and lengths.tolist() == [0]  # no match anywhere: a plain target step


def test_every_proposal_of_a_counting_target_is_accepted():
    # The target continues t with t+1 (mod 16); after one lap the text repeats, lookup copies it.
    config = DecodeConfig(max_new_tokens=1 + 4 * 5, block_size=4)
    [gen] = lookup_generate(CountingTarget(), [list(range(16)) + [0]], config)
    assert gen.tokens == [(1 + i) % 16 for i in range(21)]
    assert gen.acceptance_lengths == [4] * 5  # 3 drafts accepted + the bonus, every cycle


def test_without_repetition_each_cycle_is_one_target_step():
    config = DecodeConfig(max_new_tokens=10, block_size=8)
    [gen] = lookup_generate(CountingTarget(), [[3]], config)
    assert gen.tokens == list(range(4, 14))
    assert gen.acceptance_lengths == [1] * 9


@pytest.mark.parametrize("steps", [0, 200], ids=["random", "trained"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_lookup_output_equals_the_target_greedy_output(steps, batch_size):
    target = tiny_target(steps=steps)
    g = torch.Generator().manual_seed(7)
    ids = periodic_ids(g, 3, 3 * PERIOD)
    prompts = [ids[0, :7].tolist(), ids[1, :12].tolist(), ids[2, :PERIOD + 1].tolist(),
               torch.randint(4, VOCAB, (9,), generator=g).tolist()]
    config = DecodeConfig(max_new_tokens=24, block_size=5)
    want = [target_generate(target, [p], config)[0].tokens for p in prompts]
    gens = []
    for i in range(0, len(prompts), batch_size):
        gens += lookup_generate(target, prompts[i : i + batch_size], config)
    assert [g.tokens for g in gens] == want
    tau = acceptance_summary(gens)["tau"]
    if steps:
        assert tau > 2.5  # a periodic continuation is what lookup copies best
    assert 1.0 <= tau <= 5.0

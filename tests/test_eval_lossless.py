"""Greedy speculative decoding outputs exactly the target's own greedy tokens (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from dflash.eval.speculative import (
    DecodeConfig,
    acceptance_summary,
    speculative_generate,
    target_generate,
)
from test_eval_support import PERIOD, periodic_ids, tiny_drafter, tiny_target

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    return tiny_target()


DFLASH2 = dict(drafter_type="dflash2", selector_rank=16, selector_top_k=8)


@pytest.fixture(scope="module")
def drafters(target):
    """DFlash and DFlash2 (drafts walked by its candidate selector), untrained and trained."""
    return {"untrained": tiny_drafter(target, steps=0), "trained": tiny_drafter(target, steps=150),
            "dflash2 untrained": tiny_drafter(target, steps=0, **DFLASH2),
            "dflash2 trained": tiny_drafter(target, steps=150, **DFLASH2)}


@pytest.fixture(scope="module")
def prompts():
    """Periodic prompts of different lengths (the trained pair accepts a lot) and a random one."""
    g = torch.Generator().manual_seed(11)
    ids = periodic_ids(g, 3, 3 * PERIOD)
    return [ids[0, :7].tolist(), ids[1, :12].tolist(), ids[2, :PERIOD].tolist(),
            torch.randint(4, 32, (9,), generator=g).tolist()]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """The target's greedy output, one prompt at a time."""
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    return [target_generate(target, [p], config)[0].tokens for p in prompts]


@pytest.mark.parametrize("which", ["untrained", "trained", "dflash2 untrained", "dflash2 trained"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_speculative_output_equals_the_target_greedy_output(target, drafters, prompts, reference, which, batch_size):
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    gens = []
    for i in range(0, len(prompts), batch_size):
        gens += speculative_generate(target, drafters[which], prompts[i : i + batch_size], config)
    assert [g.tokens for g in gens] == reference
    tau = acceptance_summary(gens)["tau"]
    if which.endswith("trained") and not which.endswith("untrained"):
        assert tau > 2.0  # acceptance differs a lot between the drafters, the output does not
    else:
        assert tau < 1.5


@pytest.mark.parametrize("which", ["trained", "dflash2 trained"])
def test_batching_leaves_each_prompts_acceptance_lengths_unchanged(target, drafters, prompts, which):
    """A batch's prompts accept, cycle by cycle, what each accepts decoded alone: tau measured at any
    --batch-size is the batch-1 tau (only the speed figures are batched ones)."""
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    alone = [speculative_generate(target, drafters[which], [p], config)[0] for p in prompts]
    batched = speculative_generate(target, drafters[which], prompts, config)
    assert [g.acceptance_lengths for g in batched] == [g.acceptance_lengths for g in alone]
    assert len({tuple(g.acceptance_lengths) for g in alone}) > 1  # the prompts do differ in acceptance


def test_batched_target_only_decoding_equals_one_prompt_at_a_time(target, prompts, reference):
    gens = target_generate(target, prompts, DecodeConfig(max_new_tokens=NEW_TOKENS))
    assert [g.tokens for g in gens] == reference
    # The reference itself is the target's plain greedy continuation (no cache, no padding).
    for prompt, want in zip(prompts, reference):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, target(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        assert ids[0, len(prompt):].tolist() == want


@pytest.mark.parametrize("which", ["trained", "dflash2 trained"])
@pytest.mark.parametrize("block_size", [2, 3])
def test_blocks_smaller_than_trained_stay_lossless(target, drafters, prompts, reference, block_size, which):
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, block_size=block_size)
    gens = speculative_generate(target, drafters[which], prompts, config)
    assert [g.tokens for g in gens] == reference
    assert max(n for g in gens for n in g.acceptance_lengths) <= block_size


def test_stop_tokens_end_each_sequence_where_the_target_would(target, drafters, prompts, reference):
    stop = reference[1][6]
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,))
    want = [r[: r.index(stop) + 1] if stop in r else r for r in reference]
    assert [g.tokens for g in target_generate(target, prompts, config)] == want
    assert [g.tokens for g in speculative_generate(target, drafters["trained"], prompts, config)] == want


def test_sampled_dflash2_decoding_follows_the_target_distribution(target, drafters, prompts):
    """At T = 1 the selector samples its walk; the second output token (the first one a draft
    can decide) must still follow the target's own distribution, computed exactly here."""
    prompt, n = prompts[3], 600
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = (first[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)
    config = DecodeConfig(max_new_tokens=3, temperature=1.0, seed=5)
    gens = speculative_generate(target, drafters["dflash2 trained"], [prompt] * n, config)
    drawn = torch.bincount(torch.tensor([g.tokens[1] for g in gens]), minlength=second.shape[0]).double() / n
    tolerance = 4 * (second * (1 - second) / n).sqrt() + 0.005  # ~4 standard errors per token
    assert ((drawn - second.double()).abs() <= tolerance.double()).all()
    assert max(n for g in gens for n in g.acceptance_lengths) > 1  # the sampled drafts were accepted at times

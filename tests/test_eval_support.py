"""Tiny target/drafter pairs for the eval tests, and the engine's bookkeeping on scripted pairs.

`scripted` pairs replace the target by a module whose next-token rule is known and the
drafter's block by drafts whose correctness the test decides, so acceptance lengths, tau
and the sampling rule can be checked against their definitions exactly.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from anchor_utils import loss_of
from dflash.eval.speculative import (
    DecodeConfig,
    DraftContext,
    Generation,
    acceptance_summary,
    first_divergence,
    speculative_generate,
    target_generate,
)
from dflash.eval.target import capture_hidden
from dflash.runtime.errors import SettingError
from dflash.train.loss.objective import ObjectiveConfig
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.drafter_config import DrafterConfig
from dflash.train.model.target_weights import TargetWeights
from reference_decoding import ContextCache
from transformers import AutoModelForCausalLM, Qwen3Config

VOCAB, PERIOD, LAYER_IDS = 32, 5, [1, 3]


def periodic_ids(generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Rows repeating a random PERIOD-token pattern (ids 4..VOCAB-1)."""
    pattern = torch.randint(4, VOCAB, (batch, PERIOD), generator=generator)
    return pattern.repeat(1, length // PERIOD + 1)[:, :length]


def tiny_target(steps: int = 200, seed: int = 0) -> torch.nn.Module:
    """A 4-layer Qwen3 target, trained briefly to continue periodic sequences (steps=0: random).

    Trained once per session (seconds on a CPU) and copied: every caller gets its own module."""
    return copy.deepcopy(_trained_target(steps, seed))


@functools.cache
def _trained_target(steps: int, seed: int) -> torch.nn.Module:
    config = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = periodic_ids(g, 16, 30)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def tiny_drafter(target: torch.nn.Module, steps: int = 0, block_size: int = 4, seed: int = 0,
                 **overrides) -> DFlashDrafter:
    """A 1-layer drafter on `target`, trained `steps` steps on the target's own states
    (`overrides`: more DrafterConfig fields, e.g. drafter_type="dflash2").

    Trained once per session for each target (by its weights) and settings, and copied."""
    if steps == 0:
        return _drafter(target, steps, block_size, seed, **overrides)
    key = (weights_digest(target), steps, block_size, seed, tuple(sorted(overrides.items())))
    if key not in _TRAINED_DRAFTERS:
        _TRAINED_DRAFTERS[key] = _drafter(target, steps, block_size, seed, **overrides)
    return copy.deepcopy(_TRAINED_DRAFTERS[key])


_TRAINED_DRAFTERS: dict[tuple, DFlashDrafter] = {}


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _drafter(target: torch.nn.Module, steps: int, block_size: int, seed: int, **overrides) -> DFlashDrafter:
    config = DrafterConfig.from_target_config(
        target.config, num_hidden_layers=1, target_layer_ids=LAYER_IDS, block_size=block_size,
        attention_backend="sdpa", **{"drafter_type": "dflash", **overrides})
    weights = TargetWeights(embed_tokens=target.get_input_embeddings().weight.detach().clone(),
                            lm_head=target.get_output_embeddings().weight.detach().clone())
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, weights)
    if steps == 0:
        return drafter.eval()
    # Training data: the target's own greedy continuations of periodic prompts, with its states.
    g = torch.Generator().manual_seed(seed + 1)
    prompts = periodic_ids(g, 64, PERIOD).tolist()
    gens = target_generate(target, prompts, DecodeConfig(max_new_tokens=25))
    all_ids = torch.tensor([p + gen.tokens for p, gen in zip(prompts, gens)])
    with torch.no_grad():
        all_hidden = capture_hidden(target(input_ids=all_ids, output_hidden_states=True).hidden_states, LAYER_IDS)
    loss_mask = torch.ones_like(all_ids[:16])
    loss_mask[:, :PERIOD] = 0
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = torch.randint(0, 64, (16,), generator=g)
        batch = {"hidden": all_hidden[rows], "input_ids": all_ids[rows], "loss_mask": loss_mask,
                 "lengths": torch.full((16,), all_ids.shape[1])}
        out = loss_of(drafter, batch, ObjectiveConfig(max_anchors=8), generator=g)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return drafter.eval()


@torch.no_grad()
def target_continuation(target: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation without a cache (the slow, obviously correct way)."""
    out = ids
    for _ in range(n):
        out = torch.cat([out, target(input_ids=out).logits[:, -1:].argmax(-1)], dim=1)
    return out[:, ids.shape[1]:]


# -- scripted pairs ---------------------------------------------------------------------------


class CountingTarget(torch.nn.Module):
    """A fake causal LM whose greedy next token after t is (t + 1) mod V, or which samples from a
    fixed distribution `probs` (context-free). Hidden states are zeros."""

    def __init__(self, vocab: int = 16, width: int = 64, layers: int = 4, probs: torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab, self.width, self.layers, self.probs = vocab, width, layers, probs
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.config = None

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                output_hidden_states=False, logits_to_keep=0, **_):
        if self.probs is not None:
            logits = self.probs.log().expand(*input_ids.shape, -1).clone()
        else:
            logits = torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float() * 10
        zeros = torch.zeros(*input_ids.shape, self.width)
        return SimpleNamespace(logits=logits, hidden_states=(zeros,) * (self.layers + 1))


def scripted_drafter(vocab: int = 16) -> DFlashDrafter:
    config = DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=64, vocab_size=vocab, num_target_layers=4, num_hidden_layers=1,
                           target_layer_ids=LAYER_IDS, block_size=4, drafter_type="dflash")
    return DFlashDrafter(config, TargetWeights(embed_tokens=torch.randn(vocab, 64), lm_head=torch.randn(vocab, 64)))


def script_drafts(monkeypatch, correct_per_cycle: list[int], vocab: int = 16) -> None:
    """Drafts of cycle c are right (anchor+1, anchor+2, ...) for the first correct_per_cycle[c] slots."""
    cycle = iter(correct_per_cycle)

    def draft(self, anchor_ids, anchor_positions, block_size):
        right = next(cycle)
        slots = torch.arange(1, block_size)
        tokens = (anchor_ids[:, None] + slots + (slots > right).long()) % vocab
        return torch.nn.functional.one_hot(tokens, vocab).float()

    monkeypatch.setattr(DraftContext, "draft", draft)


def test_tau_is_the_mean_of_accepted_plus_one_per_cycle(monkeypatch):
    correct = [0, 3, 1, 2, 3, 0]  # drafts that match the target, per cycle (block 4: at most 3)
    script_drafts(monkeypatch, correct)
    produced = 1 + sum(c + 1 for c in correct)  # the prefill token, then accepted + bonus per cycle
    config = DecodeConfig(max_new_tokens=produced)
    [gen] = speculative_generate(CountingTarget(), scripted_drafter(), [[5, 6, 7]], config)
    assert gen.acceptance_lengths == [c + 1 for c in correct]
    assert gen.tokens == [(8 + i) % 16 for i in range(produced)]  # the target's own continuation
    summary = acceptance_summary([gen])
    assert summary["tau"] == pytest.approx(sum(c + 1 for c in correct) / len(correct)) == pytest.approx(15 / 6)
    assert summary["histogram"] == {"1": 2, "2": 1, "3": 1, "4": 2}
    assert summary["cycles"] == 6


def test_a_smaller_block_verifies_the_first_drafts_of_the_trained_block(monkeypatch):
    drafted_widths = []

    def draft(self, anchor_ids, anchor_positions, block_size):
        drafted_widths.append(block_size)
        slots = torch.arange(1, block_size)
        right = (anchor_ids[:, None] + slots) % 16  # every draft matches the counting target
        return torch.nn.functional.one_hot(right, 16).float()

    monkeypatch.setattr(DraftContext, "draft", draft)
    config = DecodeConfig(max_new_tokens=1 + 3 * 4, block_size=3)  # the drafter was trained at 4
    [gen] = speculative_generate(CountingTarget(), scripted_drafter(), [[5]], config)
    assert drafted_widths == [4] * 4  # drafted at the trained size, as in training
    assert gen.acceptance_lengths == [3] * 4  # 2 drafts verified + the bonus
    assert gen.tokens == [(6 + i) % 16 for i in range(13)]
    with pytest.raises(SettingError) as refused:  # a ValueError too
        speculative_generate(CountingTarget(), scripted_drafter(), [[5]], DecodeConfig(block_size=5))
    assert refused.value.code == "eval.block-size-range"
    assert refused.value.fields == {"flag": "--block-size", "value": 5, "trained": 4}


def test_summary_pools_cycles_of_all_sequences():
    gens = [Generation(tokens=[], acceptance_lengths=[1, 4]), Generation(tokens=[], acceptance_lengths=[2])]
    assert acceptance_summary(gens) == {"tau": pytest.approx(7 / 3), "cycles": 3,
                                        "histogram": {"1": 1, "2": 1, "4": 1}}
    assert acceptance_summary([Generation(tokens=[1])])["tau"] == 0.0
    drafted = [Generation(tokens=[], acceptance_lengths=[1, 4], drafted=[3, 2])]
    assert acceptance_summary(drafted)["drafted_per_cycle"] == 2.5  # only where the decoder records its drafts
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_stop_token_inside_an_accepted_block_ends_the_output(monkeypatch):
    script_drafts(monkeypatch, [3, 3, 3])
    config = DecodeConfig(max_new_tokens=50, stop_token_ids=(12,))
    [gen] = speculative_generate(CountingTarget(), scripted_drafter(), [[3]], config)
    assert gen.tokens == [4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_sampling_follows_the_target_distribution_whatever_the_drafter_proposes(monkeypatch):
    # The drafter always proposes token 0; the target's distribution is context-free.
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * 13)
    monkeypatch.setattr(DraftContext, "draft", lambda self, a, p, b: torch.zeros(a.shape[0], b - 1, 16).index_fill_(2, torch.tensor([0]), 1.0))
    config = DecodeConfig(max_new_tokens=12, temperature=1.0, seed=3)
    gens = speculative_generate(CountingTarget(probs=probs), scripted_drafter(), [[1]] * 300, config)
    counts = Counter(t for g in gens for t in g.tokens)
    total = sum(counts.values())
    assert total == 300 * 12
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / total - p) < 0.03  # ~4 standard errors
    summary = acceptance_summary(gens)
    # Token 0 is accepted with probability 0.5 per slot: E[accepted + 1] = 1 + .5 + .25 + .125 for block 4.
    assert summary["tau"] == pytest.approx(1.875, abs=0.1)


def test_draft_context_with_padding_and_holes_equals_the_drafter_incremental_path():
    torch.manual_seed(0)
    drafter = tiny_drafter(tiny_target(steps=0))
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 2 * 64, generator=g)
    anchors = torch.tensor([7, 9])
    # Row 0: 6 context tokens left-padded by 2 plus a hole at column 5; row 1: 8 tokens.
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :2] = False
    valid[0, 5] = False
    positions = torch.stack([(valid[0].long().cumsum(0) - 1).clamp(min=0), torch.arange(9)])
    valid[1, 8] = False
    context = DraftContext(drafter)
    context.append(hidden[:, :4], positions[:, :4], valid[:, :4])  # in two chunks, as cycles arrive
    context.append(hidden[:, 4:], positions[:, 4:], valid[:, 4:])
    got = context.draft(anchors, valid.sum(1), 4)
    for row in range(2):
        cache = ContextCache(drafter)
        cache.append_context(hidden[row : row + 1, valid[row]])
        torch.testing.assert_close(got[row], cache.draft_block(anchors[row : row + 1])[0], rtol=1e-5, atol=1e-5)


def test_tiny_target_learns_to_continue_the_period():
    target = tiny_target()
    g = torch.Generator().manual_seed(5)
    ids = periodic_ids(g, 8, PERIOD * 2)
    copied = target_continuation(target, ids, PERIOD) == ids[:, :PERIOD]  # the target repeats the period
    assert copied.float().mean() > 0.9

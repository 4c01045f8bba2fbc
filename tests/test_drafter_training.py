"""The drafter learns a task whose next tokens follow from the context."""

from __future__ import annotations

import time

import torch
from anchor_utils import loss_of
from dflash.train.loss.objective import ObjectiveConfig
from dflash.train.measure.metrics import BlockMetrics
from test_drafter_support import HIDDEN, tiny_drafter

PERIOD, SEQ_LEN, BATCH, STEPS = 5, 32, 8, 200


def periodic_batch(generator: torch.Generator, token_table: torch.Tensor) -> dict:
    """Sequences repeating a random 5-token pattern; the 'target' states embed each token.

    Token p+k equals token p+k-5, which lies in the context strictly before any anchor p for
    k <= 4, so a drafter that reads its context can predict a whole block of 4.
    """
    pattern = torch.randint(0, 100, (BATCH, PERIOD), generator=generator)
    ids = pattern.repeat(1, SEQ_LEN // PERIOD + 1)[:, :SEQ_LEN]
    loss_mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
    loss_mask[:, :PERIOD] = 0  # the first period plays the prompt
    return {
        "hidden": token_table[ids].to(torch.bfloat16),
        "input_ids": ids,
        "loss_mask": loss_mask,
        "lengths": torch.full((BATCH,), SEQ_LEN),
    }


def evaluate(drafter, batch) -> dict[str, float]:
    metrics = BlockMetrics(block_size=drafter.config.block_size)
    with torch.no_grad():
        out = loss_of(drafter, batch, ObjectiveConfig(max_anchors=64), generator=torch.Generator().manual_seed(0))
    metrics.update(out.correct, out.valid, out.loss)
    return metrics.compute()


def test_training_on_a_periodic_task_lowers_loss_and_raises_acceptance_length():
    # Tiny matrices: one thread is as fast as two and does not stall when the suite runs
    # beside other work on the same cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_periodic_training()
    finally:
        torch.set_num_threads(threads)


def run_periodic_training():
    torch.manual_seed(0)
    drafter = tiny_drafter().train()
    token_table = torch.randn(128, 2 * HIDDEN, generator=torch.Generator().manual_seed(1))
    data_rng, anchor_rng = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    held_out = periodic_batch(torch.Generator().manual_seed(99), token_table)
    before = evaluate(drafter, held_out)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    objective = ObjectiveConfig(max_anchors=8, noise_type="uniform", noise_start=0.05, noise_end=0.0)
    start = time.perf_counter()
    for step in range(STEPS):
        out = loss_of(
            drafter, periodic_batch(data_rng, token_table), objective,
            generator=anchor_rng, progress=step / STEPS,
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
    elapsed = time.perf_counter() - start

    after = evaluate(drafter, held_out)
    print(f"before {before}\nafter {after}\n{STEPS} steps in {elapsed:.1f} s")
    assert after["loss"] < 0.25 * before["loss"]
    assert before["tau"] < 1.2
    assert after["tau"] > 3.0  # of at most 4 with blocks of 4
    assert after["acc_3"] > 0.8

"""bench/bench_selector_grad.py: the candidates of a step drawn as a fresh drafter proposes them
(the same for every slot), as text spreads them (Zipf) and uniformly, each slot's distinct as a
top-k's, and every reduction timed under each (the timings themselves are measured on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_selector_grad  # noqa: E402


def test_the_distributions_run_from_one_shared_set_to_spread_and_keep_a_slot_s_candidates_distinct():
    g = torch.Generator().manual_seed(0)
    shares = {}
    for distribution in ("collapsed", "zipf"):
        ids = bench_selector_grad.candidates(distribution, 4096, 8192, 16, g)
        assert ids.shape == (4096, 17) and 0 <= int(ids.min()) and int(ids.max()) < 8192
        picked = ids[:, :16].sort(dim=1).values
        assert bool((picked[:, 1:] != picked[:, :-1]).all())  # distinct within a slot
        shares[distribution] = bench_selector_grad.spread(ids[:, :16])
    assert shares["collapsed"] == {"distinct": 16, "top_id_slot_share": 1.0}
    assert shares["zipf"]["distinct"] > 1000 and 0.05 < shares["zipf"]["top_id_slot_share"] < 0.9


def test_each_reduction_is_timed_under_each_distribution_against_zipf():
    rows = bench_selector_grad.measure(256, 1024, 32, 16, 16, torch.device("cpu"), 1)
    assert {(r["distribution"], r["op"]) for r in rows} == {
        (d, op) for d in bench_selector_grad.DISTRIBUTIONS
        for op in ("successor codebook (both trained)", "  the same, CSR gradient (no atomics)",
                   "head rows (frozen head)")}
    assert all(r["ms"] > 0 for r in rows) and {r["vs_zipf"] for r in rows if r["distribution"] == "zipf"} == {1.0}


def test_the_csr_gradient_sums_each_candidate_s_slots_as_the_scatter_add_does():
    g = torch.Generator().manual_seed(1)
    ids = bench_selector_grad.candidates("zipf", 300, 512, 16, g)
    grad, x = torch.randn(300, 17, generator=g, dtype=torch.float64), torch.randn(300, 8, generator=g, dtype=torch.float64)
    want = torch.zeros(512, 8, dtype=torch.float64).index_put_(
        (ids.reshape(-1),), (grad[:, :, None] * x[:, None, :]).reshape(-1, 8), accumulate=True)
    got = bench_selector_grad.csr_table_grad(512, grad, x, ids)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)

"""bench/profile_step.py on the CPU: each variant's phases with their fastest, median and slowest step,
so that a slow step shows in which phase it was, and how spread DFlash2's candidates were (the
timings themselves are measured on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_each_variant_reports_every_phase_s_spread_around_its_mean(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--shape", "small", "--steps", "3", "--device", "cpu",
                    "--variants", "dflash,dflash2", "--json", str(out)], check=True, cwd=BENCH, capture_output=True)
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"dflash", "dflash2"}
    for result in variants.values():
        assert set(result["spread_s"]) == {"step_s", "forward_s", "backward_s", "optimizer_s"}
        for phase, (low, median, high) in result["spread_s"].items():
            assert 0 < low <= median <= high
            assert low <= result[phase] <= high  # the mean of the same steps lies between them
    assert variants["dflash"]["candidates"] is None  # DFlash proposes no candidates
    spread = variants["dflash2"]["candidates"]  # the timed steps' top-16 of every scored slot
    assert spread["slots"] > 0 and 16 <= spread["distinct"] <= 16 * spread["slots"]
    assert 0 < spread["top_id_slot_share"] <= 1

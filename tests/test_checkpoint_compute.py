"""A checkpoint records the compute settings that decide a step's bits; a resume under other
settings gets one notice naming what changed (it continues correctly but not bit-identically)."""

from __future__ import annotations

import json

import torch
from dflash.train.run.checkpoint import (
    Checkpointer,
    compute_changes,
    compute_settings,
)


def test_a_checkpoint_records_its_compute_settings_and_a_resume_under_others_is_told(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    model = torch.nn.Linear(2, 2)
    path = checkpoints.save(1, model.state_dict(), {}, {}, {"identity": {}})
    saved = json.loads((path / "meta.json").read_text())["compute"]
    assert saved == compute_settings() and saved["cpu_threads"] == torch.get_num_threads()
    assert compute_changes(saved) is None and compute_changes(None) is None  # same settings, or an older checkpoint

    note = compute_changes({**saved, "cpu_threads": saved["cpu_threads"] + 1})
    assert note.code == "train.resume-compute-changed"
    assert note.fields["changes"] == [["cpu_threads", saved["cpu_threads"] + 1, saved["cpu_threads"]]]

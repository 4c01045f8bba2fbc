"""Two processes (torchrun's environment, gloo on CPU) train what one process trains with the same global
batch, and their checkpoint resumes on one process: every registered head (DFlash's backbone alone, DFlash2's
convolutions and candidate selector, DSpark's Markov and confidence heads, XPress's refiner, LiLiCorr's
correlator: the heads' modules the loss calls outside the drafter's forward), with the held-out evaluation
(the head's tau and the backbone's) on both ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import free_port, read_metrics, tiny_train_config
from dflash.train.heads import get_head, head_names
from dflash.train.run.loop import train
from safetensors.torch import load_file

SETTINGS = dict(max_steps=6, save_interval=3, keep_checkpoints=5, epochs=3)
# Each head small, with a held-out share: its evaluation runs on both ranks. A head not listed runs
# with its defaults.
HEAD_SETTINGS = {
    "dflash": dict(eval_fraction=0.3),
    "dflash2": dict(selector_rank=8, selector_top_k=4, conv_group_size=8, selector_loss_weight=1.0, eval_fraction=0.3),
    "dspark": dict(markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True, eval_fraction=0.3),
    "xpress": dict(xpress_rank=8, xpress_mlp_hidden=16, xpress_topc=8, eval_fraction=0.3),
    "lilicorr": dict(lilicorr_candidate_topk=4, lilicorr_num_layers=1, lilicorr_num_heads=4, lilicorr_factor_dim=8,
                     eval_fraction=0.3),
}


def head_settings(name: str) -> dict:
    return {"drafter_type": name, **HEAD_SETTINGS.get(name, dict(eval_fraction=0.3))}

def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5, msg=f"{k} differs")


def start_ranks(zygote, world: dict[str, Path], tmp_path: Path, out: Path, **overrides) -> list:
    """The two processes of `torchrun --standalone --nproc-per-node 2 -m dflash.train.cli`, forked
    from the session's zygote with the environment torchrun gives each rank."""
    values = tiny_train_config(world["cache"], world["target"], out, **{**SETTINGS, **overrides}).to_dict()
    config = tmp_path / f"{out.name}.json"
    config.write_text(json.dumps(values))
    port = free_port()
    return [zygote.run("train", ["--config", config], env={
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": out.name}) for rank in (0, 1)]


def resume_on_one_process(world: dict[str, Path], checkpoint: Path, out: Path, **overrides) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    result = train(tiny_train_config(world["cache"], world["target"], out, grad_accum=2, resume=True,
                                     **{**SETTINGS, **overrides}))
    assert result.step == SETTINGS["max_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", head_names())
def test_two_ranks_match_one_rank_with_the_same_global_batch_and_resume_on_one(tiny_world, zygote, tmp_path,
                                                                               drafter):
    kind = head_settings(drafter)
    # DDP and FSDP launches overlap with each other and with the one-process reference run.
    runs = {mode: tmp_path / mode for mode in ("ddp", "fsdp")}
    ranks = {mode: start_ranks(zygote, tiny_world, tmp_path, out, grad_accum=1, parallel=mode, **kind)
             for mode, out in runs.items()}
    # One process, two micro-batches per step: the same 2 global batches per step. Each rank
    # reads one of them: a gradient not reduced over the ranks (the selector's too) shows here.
    one = tmp_path / "one-rank"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], one, grad_accum=2, **SETTINGS, **kind))
    for mode, procs in ranks.items():
        for rank, proc in enumerate(procs):
            assert proc.wait(timeout=180) == 0, f"{mode} rank {rank}: {proc.output()[-4000:]}"

    one_log = [r for r in read_metrics(one) if r["kind"] == "train"]
    for mode, two in runs.items():
        for step in (3, 6):
            assert_close_weights(weights(two, step), weights(one, step))
        # Metrics are reduced over both ranks: each logged step counts both ranks' blocks.
        two_log = [r for r in read_metrics(two) if r["kind"] == "train"]
        assert [round(r["blocks"]) for r in two_log] == [round(r["blocks"]) for r in one_log]
        # The 2-rank checkpoint of step 3 (full state, also under FSDP) continues on one process.
        resumed = tmp_path / f"{mode}-resumed-on-one"
        resume_on_one_process(tiny_world, two / "checkpoints" / "step-000003", resumed, **kind)
        assert_close_weights(weights(resumed, 6), weights(two, 6))
    # The held-out evaluation ran on both ranks, the same under DDP and FSDP: the head's tau, and the
    # backbone's beside it where the head picks the drafts.
    picks = get_head(drafter).picks_drafts
    ddp, fsdp = ([r for r in read_metrics(runs[mode]) if r["kind"] == "eval"] for mode in ("ddp", "fsdp"))
    assert ddp and len(fsdp) == len(ddp)
    for a, b in zip(fsdp, ddp):
        assert a["blocks"] == b["blocks"] > 0 and ("tau_backbone" in a) == ("tau_backbone" in b) == picks
        assert a["tau"] == pytest.approx(b["tau"]) and a.get("tau_backbone") == pytest.approx(b.get("tau_backbone"))
    # Every held-out batch is evaluated once whatever the ranks (an odd count is not cut to an
    # even one), and the estimate's interval resamples every rank's walked samples: the
    # one-process run's figures.
    single = [r for r in read_metrics(one) if r["kind"] == "eval"]
    assert len(single) == len(ddp) and all(len(r["tau_interval"]) == 2 for r in ddp)
    for a, b in zip(ddp, single):
        assert (a["walked_samples"], a["blocks"]) == (b["walked_samples"], b["blocks"])
        assert a["tau"] == pytest.approx(b["tau"], rel=1e-6)
        assert a["tau_interval"] == pytest.approx(b["tau_interval"], rel=1e-6)

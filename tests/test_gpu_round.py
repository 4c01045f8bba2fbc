"""bench/gpu_round.py: the detached runner of a round of GPU benchmark jobs (needs, priorities,
slots, jobs that run alone, skips, resume), on tiny shell jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_round  # noqa: E402
from gpu_round import Job  # noqa: E402


@pytest.fixture
def round_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUND", str(tmp_path / "round"))
    monkeypatch.setenv("ROUND_POLL", "0.05")
    return tmp_path / "round"


def plan(monkeypatch, jobs):
    monkeypatch.setitem(gpu_round.PLANS, "t", lambda: jobs)


def states(root: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (root / "jobs").glob("*.json")}


def events(root: Path) -> list[str]:
    return (root / "events").read_text().split()


def mark(name: str, root: Path, seconds: float = 0.0) -> str:
    """A job that logs its start and end (with a pause between) to ROUND/events."""
    return f"echo {name}+ >> {root}/events; sleep {seconds}; echo {name}- >> {root}/events"


def test_needs_order_the_jobs_and_a_failed_need_skips_its_dependents(round_dir, monkeypatch):
    round_dir.mkdir()
    plan(monkeypatch, [
        Job("prep", mark("prep", round_dir, 0.2), [], 1),
        Job("a", mark("a", round_dir), ["prep"], 2),
        Job("bad", "exit 3", ["prep"], 2),
        Job("after-bad", mark("after-bad", round_dir), ["bad"], 3),
        Job("last", mark("last", round_dir), [], 9, after=["a", "bad", "after-bad"]),
    ])
    assert gpu_round.run_plan("t", slots=4) == 1
    s = states(round_dir)
    assert s["prep"]["state"] == s["a"]["state"] == s["last"]["state"] == "done"
    assert s["bad"]["state"] == "failed" and s["bad"]["rc"] == 3
    assert s["after-bad"]["state"] == "skipped" and "bad" in s["after-bad"]["why"]
    ev = events(round_dir)
    assert ev.index("prep-") < ev.index("a+")  # a need ends before its dependent starts
    assert ev[-2:] == ["last+", "last-"]  # `after` waits for jobs that failed or were skipped too
    assert "after-bad+" not in ev
    assert json.loads((round_dir / "finished").read_text())["failed"] == ["after-bad", "bad"]


def test_slots_bound_the_jobs_at_once_and_an_alone_job_shares_the_gpu_with_none(round_dir, monkeypatch):
    round_dir.mkdir()
    plan(monkeypatch, [Job(f"j{i}", mark(f"j{i}", round_dir, 0.3), [], 2) for i in range(4)]
         + [Job("timing", mark("timing", round_dir, 0.3), [], 1, alone=True)])
    assert gpu_round.run_plan("t", slots=2) == 0
    running, most = set(), 0
    for e in events(round_dir):
        name, edge = e[:-1], e[-1]
        if edge == "+":
            running.add(name)
            most = max(most, len(running))
            assert name != "timing" or running == {"timing"}
            assert "timing" not in running or name == "timing"
        else:
            running.discard(name)
    assert most == 2
    assert events(round_dir)[:2] == ["timing+", "timing-"]  # the lowest priority number goes first


def test_each_job_is_told_how_many_share_the_gpu_with_it_the_rounds_slots_or_one_alone(round_dir, monkeypatch):
    round_dir.mkdir()
    monkeypatch.setenv("SLOTS", "7")  # not the runner's --slots: the variable is the runner's own figure
    says = f"echo $DFLASH_QUALITY_SIDE_BY_SIDE > {round_dir}/"
    plan(monkeypatch, [Job("shared", says + "shared", [], 2), Job("alone", says + "alone", [], 1, alone=True)])
    assert gpu_round.run_plan("t", slots=3) == 0
    assert (round_dir / "shared").read_text().strip() == "3"
    assert (round_dir / "alone").read_text().strip() == "1"


def test_a_job_whose_need_still_runs_keeps_a_slot_from_later_priority_jobs_ready_first(round_dir, monkeypatch):
    # Two domains: b's preparation ends first, and b's sweep runs (priority 4) would fill every
    # slot before a's main run (priority 2), whose preparation still runs, could start.
    round_dir.mkdir()
    plan(monkeypatch, [
        Job("a-prep", mark("a-prep", round_dir, 0.6), [], 1),
        Job("b-prep", mark("b-prep", round_dir, 0.05), [], 1),
        Job("a-main", mark("a-main", round_dir, 0.3), ["a-prep"], 2),
        Job("b-main", mark("b-main", round_dir, 0.3), ["b-prep"], 2),
        *(Job(f"b-{x}", mark(f"b-{x}", round_dir, 0.3), ["b-prep"], 4) for x in ("x", "y")),
    ])
    assert gpu_round.run_plan("t", slots=2) == 0
    ev = events(round_dir)
    assert ev.index("b-main+") < ev.index("a-prep-")  # a free slot is still used
    # no sweep run starts while a-main waits on its need (then both may start in one poll)
    assert ev.index("a-prep-") < min(ev.index("b-x+"), ev.index("b-y+"))
    running, most = set(), 0
    for e in ev:
        (running.add if e[-1] == "+" else running.discard)(e[:-1])
        most = max(most, len(running))
    assert most <= 2


def test_a_rerun_skips_what_is_done_and_reruns_what_failed(round_dir, monkeypatch):
    round_dir.mkdir()
    flag = round_dir / "fixed"
    plan(monkeypatch, [Job("once", mark("once", round_dir), [], 1),
                       Job("flaky", f"test -f {flag}", [], 1)])
    assert gpu_round.run_plan("t", slots=2) == 1
    flag.touch()
    assert gpu_round.run_plan("t", slots=2) == 0
    assert events(round_dir).count("once+") == 1
    assert states(round_dir)["flaky"]["state"] == "done"


def test_collect_keeps_records_and_logs_and_leaves_caches_and_weights(round_dir, monkeypatch, tmp_path):
    (round_dir / "logs").mkdir(parents=True)
    (round_dir / "logs" / "a.log").write_text("hello\n")
    (round_dir / "quality-code" / "cache").mkdir(parents=True)
    (round_dir / "quality-code" / "cache" / "manifest.json").write_text("{}")
    (round_dir / "quality-code" / "stages").mkdir()
    (round_dir / "quality-code" / "stages" / "target.json").write_text("{}")
    (round_dir / "quality-code" / "run-e6" / "final").mkdir(parents=True)
    (round_dir / "quality-code" / "run-e6" / "final" / "model.safetensors").write_bytes(b"x" * 10)
    gpu_round.collect(tmp_path / "out")
    import tarfile

    with tarfile.open(tmp_path / "out" / "round.tgz") as tar:
        names = set(tar.getnames())
    assert names == {"logs/a.log", "quality-code/stages/target.json"}


def test_wait_stopped_by_sigterm_still_returns_what_the_round_wrote(round_dir, tmp_path):
    import signal
    import subprocess
    import time

    (round_dir / "logs").mkdir(parents=True)
    (round_dir / "logs" / "a.log").write_text("hello\n")
    (round_dir / "runner.pid").write_text("1\n")  # a round still running: no `finished` mark
    out = tmp_path / "out"
    script = Path(gpu_round.__file__)
    proc = subprocess.Popen([sys.executable, str(script), "wait", "600"], stdout=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "OUT": str(out)})
    time.sleep(1.5)  # inside its wait
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert time.time() - start < 30 and proc.returncode == 3  # stopped early, the round not finished
    assert "round still running" in stdout and (out / "round.tgz").is_file()


def test_variants_keep_only_the_named_runs_and_what_they_need(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    monkeypatch.setenv("VARIANTS", "dflash extra specforge-same")
    names = {j.name for j in gpu_round.leaderboard(extract=False)}
    assert names == {"code-prep", "code-dflash", "code-extra", "code-peers-prep", "code-specforge-same",
                     "prose-prep", "prose-dflash", "prose-peers-prep", "prose-specforge-same",
                     "code-tables", "prose-tables"}
    monkeypatch.setenv("PEERS_OWN", "1")
    monkeypatch.setenv("VARIANTS", "code-specforge-own modelopt-own")  # a whole name keeps one domain's run
    names = {j.name for j in gpu_round.leaderboard(extract=False)}
    assert names == {"code-prep", "code-peers-prep", "code-specforge-own", "code-modelopt-own",
                     "prose-prep", "prose-peers-prep", "prose-modelopt-own", "code-tables", "prose-tables"}
    monkeypatch.setenv("VARIANTS", "code-specforge-own")  # no run of prose left: nor its prep and table
    assert {j.name for j in gpu_round.leaderboard(extract=False)} == {
        "code-prep", "code-peers-prep", "code-specforge-own", "code-tables"}
    monkeypatch.delenv("PEERS_OWN")
    monkeypatch.delenv("VARIANTS")
    assert {"code-dflash2", "prose-e4", "code-modelopt-same"} <= {j.name for j in gpu_round.leaderboard(extract=False)}


def test_a_job_out_of_gpu_memory_beside_others_runs_once_more_alone(round_dir, monkeypatch):
    round_dir.mkdir()
    flag = round_dir / "tried"
    oom = (f"if [ ! -e {flag} ]; then touch {flag}; echo 'torch.OutOfMemoryError: CUDA out of memory.'; exit 1; fi; "
           + mark("oom", round_dir))
    plan(monkeypatch, [
        Job("oom", oom, [], 1),
        Job("other", mark("other", round_dir, 0.6), [], 1),
        Job("plain-failure", "echo 'no memory here'; exit 2", [], 1),
    ])
    assert gpu_round.run_plan("t", slots=4) == 1
    s = states(round_dir)
    assert s["oom"]["state"] == "done" and s["plain-failure"]["state"] == "failed"
    ev = events(round_dir)
    assert ev.index("other-") < ev.index("oom+")  # the rerun waited for the GPU to itself
    assert "CUDA out of memory" in (round_dir / "logs" / "oom.oom.log").read_text()
    assert not (round_dir / "logs" / "plain-failure.oom.log").exists()


def test_a_sweep_adds_named_runs_of_ours_with_their_flags_on_each_domain(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    monkeypatch.setenv("SWEEP", "d2-a0.5=--drafter-type dflash2 --selector-loss-weight 0.5; k8=--selector-top-k 8")
    monkeypatch.setenv("VARIANTS", "dflash d2-a0.5 k8")
    jobs = {j.name: j for j in gpu_round.leaderboard(extract=False)}
    assert {"code-d2-a0.5", "prose-d2-a0.5", "code-k8", "prose-k8", "code-dflash"} <= set(jobs)
    assert jobs["prose-d2-a0.5"].command.endswith('main "1 --drafter-type dflash2 --selector-loss-weight 0.5"')
    assert jobs["code-k8"].needs == ["code-prep"]
    monkeypatch.setenv("SWEEP", "e10=10; e10s=10 --soft-label-weight 0.5")
    monkeypatch.setenv("VARIANTS", "e10 e10s")
    jobs = {j.name: j for j in gpu_round.leaderboard(extract=False)}
    assert jobs["code-e10"].command.endswith('main "10"')  # its own epochs, not "1 10"
    assert jobs["prose-e10s"].command.endswith('main "10 --soft-label-weight 0.5"')


def test_followup_timings_keep_only_the_named_ones_and_pass_the_extraction_codecs(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    monkeypatch.setenv("TIMINGS", "extract-8b")
    monkeypatch.setenv("EXTRACT_CODECS", "bf16,bf16:0,bf16")
    monkeypatch.setenv("QUALITY", "1")
    monkeypatch.setenv("VARIANTS", "dflash")
    jobs = {j.name: j for j in gpu_round.followup()}
    assert not any(n.startswith(("profile-", "colocate")) for n in jobs)
    assert "--codecs bf16,bf16:0,bf16 " in jobs["extract-8b"].command
    assert jobs["code-dflash"].after == ["extract-8b"]  # the quality jobs wait for the timing
    monkeypatch.setenv("TIMINGS", "extract-8b profiel-dflash")
    with pytest.raises(SystemExit, match="profiel-dflash"):
        gpu_round.followup()


def test_start_beside_a_live_runner_refuses_and_leaves_its_finished_mark(round_dir):
    import os

    round_dir.mkdir()
    (round_dir / "runner.pid").write_text(f"{os.getpid()}\n")  # a live process stands in for the runner
    (round_dir / "finished").write_text("{}")
    assert gpu_round.start("leaderboard", slots=1) == 1
    assert (round_dir / "finished").is_file()  # `wait` still sees the round that ended


def test_the_recipe_plan_runs_each_key_row_beside_the_defaults_on_each_domain(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    jobs = {j.name: j for j in gpu_round.recipe()}
    for domain in ("code", "prose"):
        assert jobs[f"{domain}-dflash2"].command.endswith('main "1"')  # the defaults: a DFlash2 drafter
        assert jobs[f"{domain}-e4"].command.endswith('main "4"')
        for row, flags in gpu_round.RECIPE_ROWS.items():
            assert jobs[f"{domain}-{row}"].command.endswith(f'main "1 {flags}"')
            assert jobs[f"{domain}-{row}"].needs == [f"{domain}-prep"]
    assert not any("peers" in n or "extra" in n or "nf4" in n or n == "extract-8b" for n in jobs)
    assert "extra_samples" not in jobs["code-prep"].env["QUALITY_SETS"]  # no data only other runs train on
    monkeypatch.setenv("VARIANTS", "decay")
    monkeypatch.setenv("DOMAINS", "prose")
    assert {j.name for j in gpu_round.recipe()} == {"prose-prep", "prose-decay", "prose-tables"}


def test_status_shows_a_running_trainings_step_and_time_left(round_dir):
    """A running quality job's status line: its training's last step of the planned ones and the
    seconds left at the rate of its steps so far (metrics.jsonl's times); nothing before it trains."""
    work = round_dir / "quality-code"
    (round_dir / "jobs").mkdir(parents=True)
    (round_dir / "logs").mkdir()
    (work / "run-e10-x").mkdir(parents=True)
    (round_dir / "plan.json").write_text(json.dumps([{"name": "code-x", "env": {"WORKDIR": str(work)}}]))
    (round_dir / "jobs" / "code-x.json").write_text(json.dumps({"name": "code-x", "state": "running", "start": 1.0}))
    log = round_dir / "logs" / "code-x.log"
    log.write_text("bench/quality on cuda\n")
    assert "step" not in gpu_round.status()
    log.write_text("bench/quality on cuda\n[train-e10-x]\n")
    (work / "train-e10-x.log").write_text("data: 1 cache(s), 4096 samples; 640 optimizer steps over 10 epoch(s)\n")
    rows = [{"step": 10, "kind": "train", "time": 100.0}, {"step": 64, "kind": "eval", "time": 110.0},
            {"step": 110, "kind": "train", "time": 150.0}]
    (work / "run-e10-x" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 1')
    line = gpu_round.status()
    assert "e10-x: step 110/640, ~265 s left" in line  # 0.5 s a step, 530 steps to go
    # A finished training's stage line carries its time: the stage after it trains nothing.
    log.write_text("[train-e10-x]\n[train-e10-x] 412 s\n[eval-e10-x]\n")
    assert "step" not in gpu_round.status()


def test_a_sweep_run_warm_started_from_another_run_of_the_round_waits_for_it(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    monkeypatch.setenv("VARIANTS", "dflash d2warm")
    monkeypatch.setenv("DOMAINS", "prose")
    jobs = {j.name: j for j in gpu_round.leaderboard(extract=False, sweep="d2warm=1 --init-drafter e1-drafter-type-dflash")}
    assert jobs["prose-dflash"].command.endswith('main "1 --drafter-type dflash"')
    assert gpu_round.variant_name("1 --drafter-type dflash") == "e1-drafter-type-dflash"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "quality"))
    import stages  # the runner names variants as bench/quality does (without importing its torch)

    for variant in ("1 --drafter-type dflash", "6 --lr 3e-4 --selector-loss-weight 0.5"):
        epochs, *flags = variant.split()
        assert gpu_round.variant_name(variant) == stages.Variant(int(epochs), tuple(flags)).name
    assert jobs["prose-d2warm"].needs == ["prose-prep", "prose-dflash"]
    assert set(jobs) == {"prose-prep", "prose-dflash", "prose-d2warm", "prose-tables"}


def test_a_domains_own_quality_settings_reach_only_that_domain(round_dir, monkeypatch):
    monkeypatch.setenv("ROUND_SMALL", "1")
    monkeypatch.setenv("VARIANTS", "dflash2")
    monkeypatch.setenv("QUALITY_EXTRA_SETS", "train_top1_share=0.12")
    monkeypatch.setenv("QUALITY_EXTRA_SETS_PROSE", "prompt_percent=40")
    jobs = {j.name: j for j in gpu_round.leaderboard(extract=False)}
    assert jobs["prose-prep"].env["QUALITY_SETS"].endswith("--set train_top1_share=0.12 --set prompt_percent=40")
    assert jobs["code-prep"].env["QUALITY_SETS"].endswith("--set train_top1_share=0.12")
    assert jobs["prose-dflash2"].env["QUALITY_SETS"] == jobs["prose-prep"].env["QUALITY_SETS"]


def test_the_speed_plan_runs_each_timing_alone_most_wanted_first_and_keeps_the_named_ones(round_dir, monkeypatch):
    monkeypatch.delenv("TIMINGS", raising=False)
    jobs = gpu_round.speed()
    timings = [j for j in jobs if j.name != "gpu-hours-27b"]  # the GPU-hours are arithmetic over two timings
    assert all(j.alone for j in timings)
    assert {j.name: j for j in jobs}["gpu-hours-27b"].needs == ["extract-27b", "train-27b"]
    assert [j.name for j in sorted(jobs, key=lambda j: j.priority)][:2] == ["train-8b", "train-quality-bpe"]
    assert "--head-kernels compiled" in jobs[0].command and "--shape 8b " in jobs[0].command
    monkeypatch.setenv("HEAD_KERNELS", "eager,compiled")
    assert "--head-kernels eager,compiled" in gpu_round.speed()[0].command
    monkeypatch.setenv("ROUND_SMALL", "1")  # the CPU smoke sizes
    small = {j.name: j for j in gpu_round.speed()}
    assert "--shape small-long" in small["train-8b-32k"].command and "--shape small " in small["train-8b"].command
    monkeypatch.setenv("TIMINGS", "topk extract-long")
    assert [j.name for j in gpu_round.speed()] == ["topk", "extract-long"]
    monkeypatch.setenv("TIMINGS", "topk trian-8b")
    with pytest.raises(SystemExit, match="trian-8b"):
        gpu_round.speed()

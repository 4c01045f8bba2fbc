"""A round of GPU benchmarks as one detached pipeline of jobs, so that it outlives one command.

A GPU host may limit each command to minutes while a round of measurements takes longer. This
runner starts the round's jobs in a process of its own session (it runs on after the command that
started it returns) and lets later commands wait for it and collect what it wrote:

    python3 bench/gpu_round.py start leaderboard   # returns at once; the round runs on
    python3 bench/gpu_round.py wait 560            # until it ends, 560 s pass or SIGTERM; writes $OUT/round.tgz
    python3 bench/gpu_round.py status

A job is a shell command with the jobs it needs, a priority and a share of the GPU: at most
SLOTS jobs run at once (default 4, small models leave an H200 mostly idle), lowest priority
number first (a job whose needs are still running keeps a slot from later-priority ones that
are ready before it), and an `alone` job (a timing that must not share the GPU) runs by itself. A job
whose needs failed is skipped, and says so; a job that failed for want of GPU memory beside others
runs once more, alone (its first log kept as NAME.oom.log). Each job's output is ROUND/logs/NAME.log, its state
ROUND/jobs/NAME.json; `start` again reruns what did not finish. ROUND defaults to
/dev/shm/dflash-round. EVAL_BLOCKS (default 16) is the block sizes bench/quality decodes at
("16,8": also at 8, beside a peer's block-8 export). QUALITY_EXTRA_SETS="KEY=VALUE ..." gives bench/quality
more --set settings (train_top1_share=0.12 before a SWEEP row of --eval-fraction 0.1), and
QUALITY_EXTRA_SETS_CODE / QUALITY_EXTRA_SETS_PROSE more for one domain (prompt_percent=40 for prose).

Plans (ROUND_SMALL=1: the CPU smoke sizes, to check a plan here before it costs GPU time):

  leaderboard   bench/quality on each domain of DOMAINS (default "code prose") at COMPLETIONS
                (default 4096) completions: ours (DFlash, DFlash2, 4x the epochs, the peers' cosine
                schedule and decay weights; on code also the extra sampled completions and an nf4
                cache), SpecForge's and ModelOpt's drafters
                on the same data (bench/peers; PEERS_OWN=1: also at their own recipes), each
                decoded by dflash-eval; then, alone on the GPU, extraction of the 8B shape in
                bf16, fp8 and nf4 (bench/bench_extract.py; SKIP_EXTRACT=1 leaves it out).
                VARIANTS="dflash extra ...": only these runs of each domain (the names after
                "DOMAIN-", or a whole name such as "code-specforge-own" for one domain's run), with
                the jobs they need. SWEEP="NAME=FLAGS;NAME=FLAGS": more runs of
                ours on each domain with these dflash-train flags (e.g. "d2-a0.5=--drafter-type
                dflash2 --selector-loss-weight 0.5"), named DOMAIN-NAME; FLAGS that start
                with a number give that run's epochs ("e10=10 --soft-label-weight 0.5"), and
                `--init-drafter NAME` (bench/quality's name of another run of the round, such as
                e6-drafter-type-dflash) starts that run from the other's export, after it
                ("d2warm=2 --init-drafter e6-drafter-type-dflash": DFlash2 from the DFlash run).
  recipe        docs/recipe.md's key rows on each domain of DOMAINS at COMPLETIONS: the defaults, 4x
                the epochs, cosine schedule, exp-decay weights, 3 draft layers, no soft labels,
                gaussian noise (RECIPE_ROWS), side by side; VARIANTS keeps some of them.
  followup      alone on the GPU: the 8B extraction (bf16, nf4; EXTRACT_CODECS="bf16,bf16:0" other
                --codecs of bench_extract), the DFlash2 step's parts against DFlash at the 8B shape
                (bench/profile_step.py), extraction and training at once (bench/bench_colocate.py);
                TIMINGS="extract-8b ..." only these of them; with QUALITY=1 then the leaderboard's
                quality jobs.
  speed         alone on the GPU, the default path's speed figures, most wanted first: bench_train's
                DFlash and DFlash2 compiled (8B, quality-bpe; HEAD_KERNELS=eager,compiled: the head loss's
                eager path beside it), the same with drafters drawn wider (DFlash2's candidates spread:
                8b-spread, quality-bpe-spread), DFlash2's parts (profile_step),
                the top-K widths (bench_topk_train), the selector's gather-reductions by how spread the
                candidates are (bench_selector_grad), DFlash2 under torch.compile's other modes beside
                the default (max-autotune at 8B, CUDA graphs for the small drafter), the long samples (8b-8k, 8b-32k, 27b, 27b-32k),
                the extraction of 32K- and 8K-token samples and the 8B extraction with both references, one loader
                worker's read rate of 32K-token samples by its decode threads (loader-long), the 27B
                hybrid extraction with today's defaults and the GPU-hours from it and train-27b;
                TIMINGS="train-8b ..." only these of them, in that order.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    name: str
    command: str
    needs: list[str] = field(default_factory=list)
    priority: int = 5
    alone: bool = False
    after: list[str] = field(default_factory=list)
    """Jobs that must have ended first, well or not (where `needs` must have succeeded)."""
    env: dict[str, str] = field(default_factory=dict)


def round_dir() -> Path:
    return Path(os.environ.get("ROUND", "/dev/shm/dflash-round"))


# -- plans ------------------------------------------------------------------------------------------


def leaderboard(extract: bool | None = None, variants: list[str] | None = None,
                sweep: str | None = None) -> list[Job]:
    """The leaderboard's jobs; `extract` (default: unless SKIP_EXTRACT is set) adds the 8B
    extraction timing at the end; `variants` and `sweep` default to VARIANTS and SWEEP."""
    small = bool(os.environ.get("ROUND_SMALL"))
    completions = os.environ.get("COMPLETIONS", "64" if small else "4096")
    epochs = os.environ.get("EPOCHS", "1" if small else "10")
    more_epochs = str(4 * int(epochs))
    root = round_dir()
    jobs: list[Job] = []
    quality = "bash bench/quality/device.sh"
    keep = variants if variants is not None else os.environ.get("VARIANTS", "").split()
    for domain in os.environ.get("DOMAINS", "code prose").split():
        work = root / f"quality-{domain}"
        extra_sets = os.environ.get("QUALITY_EXTRA_SETS", "").split()  # e.g. train_top1_share=0.12
        extra_sets += os.environ.get(f"QUALITY_EXTRA_SETS_{domain.upper()}", "").split()  # this domain's own
        sets = f"--set completions={completions}" + "".join(f" --set {kv}" for kv in extra_sets)
        if domain == "code":  # the data only these variants train on
            sets += " --set extra_samples=2" * (not keep or "extra" in keep)
            sets += " --set extra_codecs=nf4" * (not keep or "nf4" in keep)
        env = {"WORKDIR": str(work), "DOMAIN": domain, "QUALITY_SETS": sets, "EVAL_BLOCKS": os.environ.get("EVAL_BLOCKS", "16" if not small else "8"),
               **({"SMALL": "1"} if small else {})}

        trains: dict[str, str] = {}  # bench/quality's variant name -> the job that trains it

        def quality_job(name: str, variant: str, priority: int, domain: str = domain, env: dict = env,
                        trains: dict = trains) -> Job:
            needs = [f"{domain}-prep"]
            words = variant.split()
            if "--init-drafter" in words[:-1]:  # a warm start from the export of another variant of the round
                needs.append(trains.get(words[words.index("--init-drafter") + 1], f"{domain}-prep"))
            trains[variant_name(variant)] = f"{domain}-{name}"
            return Job(f"{domain}-{name}", f'{quality} main "{variant}"', needs, priority,
                       env={**env, "RESULTS": str(root / "results" / f"{domain}-{name}")})

        jobs.append(Job(f"{domain}-prep", f"{quality} prep", [], 1,
                        env={**env, "RESULTS": str(root / "results" / f"{domain}-prep")}))
        # the defaults (a DFlash2 drafter) and plain DFlash beside them
        jobs += [quality_job("dflash2", epochs, 2), quality_job("dflash", f"{epochs} --drafter-type dflash", 2)]
        peers = "bash bench/peers/device.sh " + str(work)
        peer_env = {**env, "EPOCHS": epochs, **({"DEVICE": "cpu"} if small else {})}
        own = ("specforge-own", "modelopt-own") if os.environ.get("PEERS_OWN") else ()
        jobs.append(Job(f"{domain}-peers-prep", peers, [f"{domain}-prep"], 1 if own else 3,
                        env={**peer_env, "RUNS": " ", "RESULTS": str(root / "results" / f"{domain}-peers-prep")}))
        for run in ("specforge-same", "modelopt-same", *own):
            # the peers' own recipes are the round's longest jobs (ModelOpt's: 10 epochs of a wide
            # draft): started first, so that a round cut off by its device time still holds them
            jobs.append(Job(f"{domain}-{run}", peers, [f"{domain}-peers-prep"], 3 if run.endswith("same") else 2,
                            env={**peer_env, "RUNS": run, "RESULTS": str(root / "results" / f"{domain}-{run}")}))
        jobs.append(quality_job(f"e{more_epochs}", more_epochs, 3))  # the longest of ours: started first
        # ours with the two recipe choices both peers make differently (cosine, exp-decay weights):
        # whether they, or the peers' code, make the gap between us
        jobs.append(quality_job("peer-recipe", f"{epochs} --lr-schedule cosine --loss-weighting decay", 4))
        if domain == "code":
            jobs += [quality_job("extra", f"{epochs} --cache extra_cache", 4),
                     quality_job("nf4", f"{epochs} --bench-cache cache-nf4", 4)]
        for entry in filter(None, (e.strip() for e in (sweep if sweep is not None else os.environ.get("SWEEP", "")).split(";"))):
            name, _, flags = entry.partition("=")  # one more run of ours: NAME=dflash-train flags
            flags = flags.strip()
            own_epochs = flags.split(" ", 1)[0].isdigit()  # NAME=EPOCHS flags: its own epochs
            jobs.append(quality_job(name.strip(), flags if own_epochs else f"{epochs} {flags}", 4))
    if keep:  # only these runs (and what they need)
        runs = [j for j in jobs if j.name in keep or j.name.split("-", 1)[1] in keep]
        needed = {n for j in runs for n in j.needs}
        needed |= {n for j in jobs if j.name in needed for n in j.needs}
        jobs = [j for j in jobs if j in runs or j.name in needed]
    ends = [j.name for j in jobs]
    for domain in os.environ.get("DOMAINS", "code prose").split():
        work = root / f"quality-{domain}"
        env = next((j.env for j in jobs if j.name == f"{domain}-prep"), None)
        if env is None:  # VARIANTS kept no run of this domain
            continue
        peers_table = (f"python3 bench/peers/run.py --workdir {work} table > {work}/peers/table.md "
                       f"&& cat {work}/peers/table.md")
        jobs.append(Job(f"{domain}-tables", f"{quality} table && {{ [ ! -d {work}/peers ] || {{ {peers_table}; }}; }}",
                        [], 8, after=ends,
                        env={**env, "EPOCHS": epochs, "RESULTS": str(root / "results" / f"{domain}-tables")}))
    if extract is None:
        extract = not os.environ.get("SKIP_EXTRACT")
    if extract:
        command = (f"python3 bench/bench_extract.py --output {root}/extract-scratch --codecs bf16,fp8,nf4 "
                   f"--json {root}/results/extract-8b.json" + (" --small" if small else "")
                   + f"; rc=$?; rm -rf {root}/extract-scratch; exit $rc")
        jobs.append(Job("extract-8b", command, [], 9, alone=True, after=[j.name for j in jobs],
                        env={"DFLASH_PROFILE_EXTRACT": "1"}))
    return jobs


def only_timings(jobs: list[Job], plan: str) -> list[Job]:
    """The jobs TIMINGS names (all of them without it), most wanted first in the order it names them;
    a name the plan has not is refused."""
    if not os.environ.get("TIMINGS"):
        return jobs
    wanted = os.environ["TIMINGS"].split()
    unknown = set(wanted) - {j.name for j in jobs}
    if unknown:
        raise SystemExit(f"TIMINGS names {', '.join(sorted(unknown))}: {plan}'s timings are "
                         + ", ".join(j.name for j in jobs))
    return [replace(j, priority=wanted.index(j.name) + 1) for j in jobs if j.name in wanted]


def followup() -> list[Job]:
    """The figures the leaderboard round left open, each alone on the GPU first: the 8B extraction
    (bf16 and nf4, the top-1 share as extracted by default), the DFlash2 step's parts at the 8B
    shape (profile_step.py: the convolutions, the top-K and the selector against DFlash), and
    extraction and training at once on one GPU (bench_colocate.py); then, with QUALITY=1, the
    leaderboard's quality jobs (DOMAINS, COMPLETIONS as there)."""
    small = bool(os.environ.get("ROUND_SMALL"))
    root = round_dir()
    res = root / "results"
    tiny = " --small" if small else ""
    shape = "quality" if small else "8b"
    device = " --device cpu --samples 1 --steps 1 --vocab 512" if small else " --dtype bf16 --compile"
    codecs = os.environ.get("EXTRACT_CODECS", "bf16,nf4")
    jobs = [
        Job("extract-8b", f"python3 bench/bench_extract.py --output {root}/extract-scratch --codecs {codecs} "
            f"--json {res}/extract-8b.json{tiny}; rc=$?; rm -rf {root}/extract-scratch; exit $rc", [], 1,
            alone=True, env={"DFLASH_PROFILE_EXTRACT": "1"}),
        *[Job(f"profile-{kind}", f"python3 bench/profile_step.py --shape {shape} --drafter-type {kind} --profile"
              f"{device} --json {res}/profile-{kind}.json", [], 2, alone=True) for kind in ("dflash", "dflash2")],
        Job("colocate", f"python3 bench/bench_colocate.py --workdir {root}/colocate --json {res}/colocate.json{tiny}"
            f"; rc=$?; rm -rf {root}/colocate; exit $rc", [], 3, alone=True),
    ]
    jobs = only_timings(jobs, "followup")
    if os.environ.get("QUALITY"):
        timings = [j.name for j in jobs]
        for j in leaderboard(extract=False):  # the extraction timing is this plan's own, first
            jobs.append(Job(j.name, j.command, j.needs, j.priority + 10, j.alone, j.after or timings, j.env))
    res.mkdir(parents=True, exist_ok=True)
    return jobs


RECIPE_ROWS = {"cosine": "--lr-schedule cosine", "decay": "--loss-weighting decay", "layers3": "--num-draft-layers 3",
               "nosoft": "--soft-label-weight 0", "noise": "--noise-type gaussian"}
"""docs/recipe.md's key rows: each one default changed (the recipe plan's runs beside the defaults)."""


def variant_name(variant: str) -> str:
    """bench/quality's name of a variant "EPOCHS FLAGS..." (stages.Variant.name: e6-drafter-type-dflash),
    what a sweep's `--init-drafter NAME` names to start from that variant's export."""
    epochs, *flags = variant.split()
    return "-".join([f"e{epochs}", *(f.lstrip("-").replace(".", "p") for f in flags)])


def recipe() -> list[Job]:
    """docs/recipe.md's key rows on the BPE benchmark: on each domain of DOMAINS at COMPLETIONS, the
    defaults, 4x the epochs, and each of RECIPE_ROWS (one default changed), side by side on the same
    data and decoded on the same prompts; VARIANTS (default: all of them) keeps some."""
    epochs = os.environ.get("EPOCHS", "1" if os.environ.get("ROUND_SMALL") else "10")
    rows = ["dflash2", f"e{4 * int(epochs)}", *RECIPE_ROWS]  # dflash2: the defaults
    wanted = os.environ.get("VARIANTS", "").split() or rows
    return leaderboard(extract=False, variants=wanted, sweep=";".join(f"{k}={v}" for k, v in RECIPE_ROWS.items()))


def speed() -> list[Job]:
    """The default path's speed figures (docs/BENCHMARKS.md, Training and Extraction), each alone on
    the GPU, most wanted first: DFlash and DFlash2 compiled side by side at the 8B and the small
    drafter's shapes (the head loss's eager path against it is recorded; HEAD_KERNELS=eager,compiled
    measures it again), the same with drafters whose DFlash2 candidates spread, DFlash2's parts at the 8B shape, the top-K's segment widths with the maxima
    given, the selector's gather-reductions by how spread the candidates are, the long samples (8K
    and 32K tokens at the 8B shape, then the 27B shapes), the extraction of 32K-token samples, and
    the 8B extraction with both references. TIMINGS="train-8b ..." only these."""
    small = bool(os.environ.get("ROUND_SMALL"))
    root = round_dir()
    res = root / "results"

    def train(name: str, shape: str, args: str, priority: int) -> Job:
        shape = "small-long" if small and "-" in shape and shape[-1] == "k" else "small" if small else shape
        steps = " --steps 2 --warmup-steps 1" if small else ""
        return Job(f"train-{name}", f"python3 bench/bench_train.py --workdir {root}/{name} --shape {shape} {args}"
                   f"{steps} --json {res}/train-{name}.json; rc=$?; rm -rf {root}/{name}; exit $rc", [], priority,
                   alone=True)

    def dflash2_variants(name: str, shape: str, variants: list[tuple[str, str, str]]) -> Job:
        """DFlash2's step at `shape` once per (label, environment prefix, extra arguments), one after
        another in one job on one cache (the first writes it, --keep leaves it to the next)."""
        work = f"{root}/{shape}-{name}"
        runs = (f"{env}python3 bench/bench_train.py --workdir {work} --shape {'small' if small else shape} "
                f"--drafter-type dflash2{' --samples 16' if shape == '8b' else ''} --keep "
                f"--json {res}/train-{shape}-{name}-{label}.json"
                + (" --steps 2 --warmup-steps 1" if small else " --steps 20 --warmup-steps 10") + extra
                for label, env, extra in variants)
        return Job(f"train-{shape}-{name}", " && ".join(runs) + f"; rc=$?; rm -rf {work}; exit $rc", [], 5, alone=True)

    # steps in tens where a step is short: the trainer reads its metrics (a wait for the GPU) every 10 steps
    both = f"--drafter-type dflash,dflash2 --head-kernels {os.environ.get('HEAD_KERNELS', 'compiled')}"
    long = "--drafter-type dflash2,dflash --sliding-window 0,2048"
    extract = "--shape 8b --small --tokens 16384" if small else "--shape 8b"
    jobs = [
        train("8b", "8b", f"{both} --samples 16" + ("" if small else " --steps 20 --warmup-steps 10"), 1),
        train("quality-bpe", "quality-bpe", both + ("" if small else " --steps 20 --warmup-steps 10"), 2),
        # the same with drafters drawn wider, whose DFlash2 candidates spread over the vocabulary as a
        # trained drafter's follow the text (DFlash beside it as the control: its step has no candidates)
        train("8b-spread", "8b", f"{both} --drafter-init-std 0.1 --samples 16"
              + ("" if small else " --steps 20 --warmup-steps 10"), 2),
        train("quality-bpe-spread", "quality-bpe", f"{both} --drafter-init-std 0.1"
              + ("" if small else " --steps 20 --warmup-steps 10"), 2),
        Job("profile-8b", "python3 bench/profile_step.py " + ("--shape small --steps 1 --device cpu" if small else
            "--shape 8b --variants dflash,dflash2,dflash2-noconv --compile --dtype bf16 --steps 8")
            + f" --json {res}/profile-8b.json", [], 3, alone=True),
        # the same parts for the quality benchmark's small drafter (pt 3's gap), with the top kernels
        Job("profile-quality-bpe", "python3 bench/profile_step.py " + ("--shape small --steps 1 --device cpu" if small
            else "--shape quality-bpe --variants dflash,dflash2,dflash2-noconv --compile --dtype bf16 --steps 4 --profile")
            + f" --json {res}/profile-quality-bpe.json", [], 3, alone=True),
        Job("topk", "python3 bench/bench_topk_train.py" + (" --rows 64 --repeats 2 --device cpu" if small else "")
            + f" --json {res}/topk.json", [], 4, alone=True),
        # the selector's gather-reductions by how spread the candidates are (a fresh drafter's: one set)
        Job("selector-grad", "python3 bench/bench_selector_grad.py"
            + (" --slots 256 --vocab 4096 --hidden 64 --repeats 2 --device cpu" if small else "")
            + f" --json {res}/selector-grad.json", [], 4, alone=True),
        # torch.compile's other modes for DFlash2's step, each beside the default in the same job: autotuned
        # kernels at the 8B shape, CUDA graphs (no launch overhead) for the small drafter's many small kernels
        *[dflash2_variants(mode, shape, [("default", "", ""), (mode, "", f" --train-arg compile_mode={mode}")])
          for shape, mode in (("8b", "max-autotune-no-cudagraphs"), ("quality-bpe", "reduce-overhead"))],
        train("8b-8k", "8b-8k", f"{long} --samples 8" + ("" if small else " --steps 10 --warmup-steps 10"), 5),
        train("8b-32k", "8b-32k", f"{long} --samples 4" + ("" if small else " --steps 3 --warmup-steps 2"), 6),
        # DFlash2 last: gpu_hours reads the last figure of the file (today's default drafter)
        train("27b", "27b", "--drafter-type dflash,dflash2 --samples 8" + ("" if small else " --steps 10 --warmup-steps 10"), 7),
        train("27b-32k", "27b-32k", f"{long} --samples 4" + ("" if small else " --steps 3 --warmup-steps 2"), 8),
        # one loader worker's read rate by its decode threads, on the GPU host's cores (what the long steps need);
        # the cache's writing is most of its time (590 s with 4 samples and fp8 beside bf16, e8db04f): 2 samples, bf16
        Job("loader-long", "python3 bench/bench_loader.py " + ("--shape small-long --samples 2 --threads 1,2 --repeats 1"
            if small else "--shape 8b-32k --samples 2 --threads 1,3,4 --codecs bf16")
            + f" --workdir {root}/loader --json {res}/loader-long.json; rc=$?; rm -rf {root}/loader; exit $rc", [], 6,
            alone=True),
        # the default extraction of long samples against both references, 32K tokens and 8K (1M tokens at 8K, as
        # the 2,048-token rows: the fixed tail after the last batch weighed 3.5 % at 1M, and would weigh twice that at 0.5M)
        *[Job(name, f"python3 bench/bench_extract.py --output {root}/extract-scratch {extract} --codecs bf16@8 "
              + ("--seq-len 1024" if small else f"--seq-len {seq} --tokens {tokens}")
              + f" --json {res}/{name}.json; rc=$?; rm -rf {root}/extract-scratch; exit $rc", [], 9, alone=True,
              env={"DFLASH_PROFILE_EXTRACT": "1"})  # the forwards, the gaps and the tail after the last batch
          for name, seq, tokens in (("extract-long", 32768, 524288), ("extract-8k", 8192, 1048576))],
        # the 27B hybrid target with today's extraction defaults (top-8, fp8 for the seed's disk), then the
        # offline/online GPU-hours of today's defaults from it and train-27b
        Job("extract-27b", f"python3 bench/bench_extract.py --output {root}/extract-scratch --shape 27b-hybrid "
            + ("--small --tokens 16384" if small else "") + " --codecs fp8@8,bf16@8"
            + f" --json {res}/extract-27b.json; rc=$?; rm -rf {root}/extract-scratch; exit $rc", [], 11, alone=True),
        Job("gpu-hours-27b", f"python3 bench/gpu_hours.py {res}/extract-27b.json {res}/train-27b.json", ["extract-27b",
            "train-27b"], 12),
        Job("extract-8b", f"python3 bench/bench_extract.py --output {root}/extract-scratch {extract} --codecs bf16@8,bf16"
            + ("" if small else " --forward-tokens 131072")
            + f" --json {res}/extract-8b.json; rc=$?; rm -rf {root}/extract-scratch; exit $rc", [], 10, alone=True,
            env={"DFLASH_PROFILE_EXTRACT": "1"}),
    ]
    jobs = only_timings(jobs, "speed")
    res.mkdir(parents=True, exist_ok=True)
    return jobs


PLANS = {"leaderboard": leaderboard, "followup": followup, "recipe": recipe, "speed": speed}


# -- the runner -------------------------------------------------------------------------------------


def _state(name: str) -> dict:
    path = round_dir() / "jobs" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {"state": "waiting"}


def _write_state(name: str, **state) -> None:
    path = round_dir() / "jobs" / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, **state}) + "\n")
    tmp.replace(path)


def _out_of_memory(log: Path) -> bool:
    """Whether a job's log ends in CUDA's out-of-memory error (its last 64 KiB)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - 65536))
            return b"CUDA out of memory" in f.read()
    except OSError:
        return False


SHARING_ENV = "DFLASH_QUALITY_SIDE_BY_SIDE"
"""bench/quality's variable for how many jobs share the GPU (stages.SHARED_ENV)."""


def run_plan(plan: str, slots: int) -> int:
    root = round_dir()
    (root / "jobs").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    jobs = {j.name: j for j in PLANS[plan]()}
    (root / "plan.json").write_text(json.dumps([asdict(j) for j in jobs.values()], indent=1) + "\n")
    done = {n for n in jobs if _state(n).get("state") == "done"}
    failed: set[str] = set()
    retried: set[str] = set()
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stop:
        for name, (proc, started) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            if rc != 0 and name not in retried and _out_of_memory(root / "logs" / f"{name}.log"):
                # the GPU's memory was shared out among too many jobs: once more, alone
                retried.add(name)
                jobs[name] = replace(jobs[name], alone=True)
                os.replace(root / "logs" / f"{name}.log", root / "logs" / f"{name}.oom.log")
                _write_state(name, state="waiting", why="out of GPU memory beside other jobs: rerun alone")
                continue
            (done if rc == 0 else failed).add(name)
            _write_state(name, state="done" if rc == 0 else "failed", rc=rc, start=started,
                         seconds=round(time.time() - started, 1))
        for name, job in jobs.items():
            if name in done or name in failed or name in running:
                continue
            if any(n in failed for n in job.needs) and _state(name).get("state") != "skipped":
                failed.add(name)
                _write_state(name, state="skipped", why="needs failed: " + ", ".join(n for n in job.needs if n in failed))
        ready = sorted((j for n, j in jobs.items() if n not in done | failed | set(running)
                        and all(d in done for d in j.needs) and all(d in done | failed for d in j.after)),
                       key=lambda j: j.priority)
        # a more important job whose needs are still running keeps a slot for itself: a later
        # one of another domain, ready first, does not fill the GPU before it (or leave it out
        # of memory beside them)
        coming = [j for n, j in jobs.items() if n not in done | failed | set(running) and j not in ready
                  and all(d in done or d in running for d in j.needs) and any(d in running for d in j.needs)]
        for job in ready:
            kept = sum(1 for j in coming if j.priority < job.priority and not j.alone)
            if any(jobs[n].alone for n in running) or (job.alone and running) or len(running) + kept >= slots:
                break
            log = open(root / "logs" / f"{job.name}.log", "w")
            # how many jobs may share the GPU with it (the round's --slots; 1 alone): bench/quality's
            # table marks its seconds as shared
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **job.env, SHARING_ENV: str(1 if job.alone else slots)}
            proc = subprocess.Popen(["bash", "-c", job.command], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            running[job.name] = (proc, time.time())
            _write_state(job.name, state="running", start=time.time(), pid=proc.pid)
        if not running and not ready:
            break
        time.sleep(float(os.environ.get("ROUND_POLL", "2")))
    for name, (proc, started) in running.items():  # stopped: the unfinished jobs rerun next start
        os.killpg(proc.pid, signal.SIGTERM)
        _write_state(name, state="stopped", start=started)
    (root / "finished").write_text(json.dumps({"done": sorted(done), "failed": sorted(failed)}) + "\n")
    return 0 if not failed else 1


def start(plan: str, slots: int) -> int:
    root = round_dir()
    root.mkdir(parents=True, exist_ok=True)
    pid_file = root / "runner.pid"
    if pid_file.is_file():
        try:
            os.kill(int(pid_file.read_text()), 0)
            print(f"a round is already running (pid {pid_file.read_text().strip()}); `wait` for it")
            return 1
        except (OSError, ValueError):
            pass
    (root / "finished").unlink(missing_ok=True)  # only once no runner is left to write it
    with open(root / "runner.log", "a") as log:
        proc = subprocess.Popen([sys.executable, __file__, "run", plan, "--slots", str(slots)], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    print(f"round {plan} started (pid {proc.pid}) in {root}")
    return 0


TRAIN_STAGE = re.compile(r"^\[train-([^\]]+)\]$")
STEPS_PLANNED = re.compile(r"(\d+) optimizer steps over")


def training_progress(root: Path, name: str, env: dict[str, str]) -> str:
    """`VARIANT: step N/M, ~S s left` for a running job whose log shows a bench/quality training
    in progress (its `[train-VARIANT]` line without the time yet): the planned steps from the
    trainer's log in the job's WORKDIR, the last step and the rate from its run's metrics.jsonl
    (the steps since its first record). "" when the job trains nothing yet."""
    log, work = root / "logs" / f"{name}.log", env.get("WORKDIR")
    if not work or not log.is_file():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    started = [(i, m.group(1)) for i, line in enumerate(lines) if (m := TRAIN_STAGE.match(line))]
    if not started or any(line.startswith(f"[train-{started[-1][1]}] ") for line in lines[started[-1][0] + 1:]):
        return ""  # no training yet, or the last one has ended (its line with its time)
    variant = started[-1][1]
    train_log, metrics = Path(work) / f"train-{variant}.log", Path(work) / f"run-{variant}" / "metrics.jsonl"
    planned = STEPS_PLANNED.search(train_log.read_text(errors="replace")) if train_log.is_file() else None
    if not planned or not metrics.is_file():
        return ""
    rows = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the line being written
            continue
        if row.get("kind") == "train":
            rows.append((row["step"], row["time"]))
    if not rows:
        return ""
    total, (first, t0), (step, t1) = int(planned.group(1)), rows[0], rows[-1]
    left = f", ~{(t1 - t0) / (step - first) * (total - step):.0f} s left" if step > first else ""
    return f"{variant}: step {step}/{total}{left}"


def status() -> str:
    root = round_dir()
    plan = {j["name"]: j for j in json.loads((root / "plan.json").read_text())} if (root / "plan.json").is_file() else {}
    lines, now = [], time.time()
    for path in sorted((root / "jobs").glob("*.json")):
        s = json.loads(path.read_text())
        took = s.get("seconds") or (round(now - s["start"]) if s.get("start") else "")
        note = s.get("why", "")
        if s["state"] == "running":
            note = training_progress(root, s["name"], plan.get(s["name"], {}).get("env", {})) or note
        lines.append(f"  {s['name']:<28} {s['state']:<8} {took!s:>6} s  {note}")
    return "\n".join(lines)


def collect(out: Path) -> None:
    """Everything small the round wrote (logs, states, results) as out/round.tgz."""
    root = round_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "round.tgz", "w:gz") as tar:
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.stat().st_size < 4 << 20 and path.suffix in {
                    ".json", ".log", ".jsonl", ".md", ".tgz", ".txt", ".yaml"} and "/peers/ckpt/" not in str(path) \
                    and not any(p in path.parts for p in ("checkpoints", "target", "cache", "cache-nf4", "extra_cache",
                                                          "estimate_cache", "decoded_cache", "completions")):
                tar.add(path, arcname=str(path.relative_to(root)))


def wait(seconds: float) -> int:
    """Until the round ends or `seconds` pass, then its status and (with OUT) what it wrote so far,
    also when stopped early by SIGTERM or SIGINT (a command cut at its time limit, `timeout`):
    the round itself runs on."""
    root = round_dir()
    deadline = time.time() + seconds

    def on_term(*_):
        nonlocal deadline
        deadline = 0.0

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while time.time() < deadline and not (root / "finished").is_file():
        if not (root / "runner.pid").is_file():
            print(f"no round in {root}")
            return 2
        time.sleep(min(1.0, max(0.0, deadline - time.time())))
    print(status())
    for path in sorted((root / "jobs").glob("*.json")):
        s = json.loads(path.read_text())
        if s["state"] == "failed":
            log = (root / "logs" / f"{s['name']}.log").read_text().splitlines()[-12:]
            print(f"--- {s['name']} (status {s.get('rc')}):\n" + "\n".join(log))
    out = os.environ.get("OUT")
    if out:
        collect(Path(out))
    finished = (root / "finished").is_file()
    print("round finished" if finished else "round still running")
    return 0 if finished else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("start", "run", "wait", "status"))
    ap.add_argument("arg", nargs="?", help="start/run: the plan; wait: seconds")
    ap.add_argument("--slots", type=int, default=int(os.environ.get("SLOTS", "4")))
    a = ap.parse_args(argv)
    if a.what in ("start", "run") and a.arg not in PLANS:
        ap.error(f"plan: one of {', '.join(PLANS)}")
    if a.what == "start":
        return start(a.arg, a.slots)
    if a.what == "run":
        return run_plan(a.arg, a.slots)
    if a.what == "wait":
        return wait(float(a.arg or 0))
    print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())

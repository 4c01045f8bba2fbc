"""Extraction across the GPUs of one host, against one GPU of the same host, with a shared cache
and one rank killed and resumed.

    python bench/bench_scale.py --gpus 8 --workdir /dev/shm/scale --json extract-scale-8.json
    python bench/bench_scale.py --gpus 8 --shape 27b-hybrid --tokens-per-gpu 262144 --workdir /dev/shm/scale
    python bench/bench_scale.py --gpus 2 --small --workdir /tmp/scale      # CPU smoke run (2 processes)

Three runs, each rank a process of its own (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set as
torchrun sets them; dflash-extract's ranks need no collective: each takes whole sort windows,
window % world == rank, and commits its parts to the one cache):
  single   one rank over --tokens-per-gpu tokens: the one-GPU rate of this host.
  shared   --gpus ranks over --gpus x --tokens-per-gpu tokens into one cache: the aggregate rate
           (all real tokens / first batch of any rank to last commit of any rank) and the scaling
           efficiency, aggregate / (gpus x single).
  killed   the shared run again into a new cache; the last rank is SIGKILLed (with its writer
           processes) once the cache holds --kill-after-parts parts, then started again with the
           same command. It must finish, skip what it had committed, and leave a cache that
           `dflash-cache verify` passes and whose parts are exactly those of the shared run (part
           names, samples, tokens, lengths: parts are cut from the data alone).
Each rank builds the same randomly initialized target (seed 0) and, before its timed extraction,
runs one forward per distinct batch shape of its own windows (kernels that autotune per shape pay
that outside the timed span, as in bench_extract.py); then the ranks start together (a file
barrier), so unequal model-build times do not count as scaling loss. The figures are printed and, with --json,
written in the form bench/gpu_hours.py reads (`gpus` set: the extraction GPU-hours count them all).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash.cache_tools.maintenance import verify_cache
from dflash.cache_tools.manifest import LOG_FILE, decode_log_line

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def rank_main(spec: dict) -> None:
    """One rank: build the target, warm its batch shapes, extract, write its figures."""
    import torch
    from bench_extract import SHAPES, build_config, build_model, extraction_batches, sync
    from dflash.cache_tools.layers import default_target_layer_ids
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extraction
    from dflash.extract.target import LayerCapture

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    architecture, full, small = SHAPES[spec["shape"]]
    shape = small if spec["small"] else full
    if spec["device"] == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(build_config(architecture, shape), device)
    layer_ids = default_target_layer_ids(shape["num_hidden_layers"], 5)
    cfg = ExtractConfig(target_model=spec["label"], data=spec["data"], output=spec["output"], codec=spec["codec"],
                        target_layer_ids=layer_ids, token_budget=spec["token_budget"],
                        part_tokens=spec["part_tokens"], sort_window_tokens=spec["sort_window_tokens"],
                        max_seq_len=spec["max_seq_len"], device=str(device), progress=False,
                        rank=rank, world_size=world, num_writers=spec.get("num_writers"),
                        store_topk=0)  # the capture alone, as the recorded scaling figures
    batches, _ = extraction_batches(cfg, shape["vocab_size"], device, rank=rank, world_size=world)
    shapes = {tuple(b.shape): b for b in batches}
    capture = LayerCapture(model, layer_ids, need_last=False)
    with torch.inference_mode():
        for ids in shapes.values():
            capture(ids, None)
    capture.close()
    sync(device)
    # All ranks start their timed extraction together: model builds and warm-ups that end at
    # different moments would otherwise count as scaling loss in a run of seconds.
    barrier = Path(spec["barrier"])
    barrier.mkdir(parents=True, exist_ok=True)
    (barrier / f"ready-{rank}").touch()
    while len(list(barrier.glob("ready-*"))) < world:
        time.sleep(0.01)
    summary = run_extraction(cfg, model=model)
    end = time.time() - summary.teardown_seconds
    figures = {"rank": rank, "world_size": world, "tokens": summary.tokens, "seconds": summary.seconds,
               "start": end - summary.seconds, "end": end, "parts_written": summary.parts_written,
               "parts_done_before": summary.parts_done_before, "parts_this_rank": summary.parts_this_rank,
               "bytes": summary.bytes, "warmed_shapes": len(shapes)}
    Path(spec["result"]).write_text(json.dumps(figures) + "\n")
    print(summary.format(), flush=True)


class Ranks:
    """The processes of one run: started like torchrun's, each in a session of its own (a kill
    takes its writer processes too), logs under the run's directory."""

    def __init__(self, name: str, work: Path, spec: dict, world: int, device: str):
        self.name, self.dir, self.spec, self.world, self.device = name, work / name, spec, world, device
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, rank: int) -> None:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(self.world)}
        if self.device == "cpu":  # CPU ranks share the cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.world))
        spec = {**self.spec, "result": str(self.dir / f"rank-{rank}.json"), "barrier": str(self.dir / "barrier")}
        log = open(self.dir / f"rank-{rank}.log", "a")
        self.procs[rank] = subprocess.Popen([sys.executable, __file__, "--rank-spec", json.dumps(spec)], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_all(self) -> None:
        for rank in range(self.world):
            self.start(rank)

    def kill(self, rank: int) -> None:
        if self.procs[rank].poll() is not None:
            raise SystemExit(f"{self.name}: rank {rank} had finished before it could be killed; give each rank "
                             "more tokens (--tokens-per-gpu) or lower --kill-after-parts.")
        os.killpg(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in self.procs.values():
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                raise SystemExit(f"{self.name}: rank {rank} did not finish in {timeout:.0f} s; its log: "
                                 f"{self.dir / f'rank-{rank}.log'}") from None
            if rc != 0:
                tail = (self.dir / f"rank-{rank}.log").read_text()[-2000:]
                raise SystemExit(f"{self.name}: rank {rank} exited with status {rc}; the end of its log "
                                 f"({self.dir / f'rank-{rank}.log'}):\n{tail}")

    def figures(self) -> list[dict]:
        return [json.loads((self.dir / f"rank-{r}.json").read_text()) for r in range(self.world)]


def aggregate(figures: list[dict]) -> dict:
    tokens = sum(f["tokens"] for f in figures)
    span = max(f["end"] for f in figures) - min(f["start"] for f in figures)
    return {"tokens": tokens, "seconds": span, "tokens_per_second": tokens / span,
            "per_rank_tokens_per_second": [f["tokens"] / f["seconds"] for f in figures]}


def committed(cache: Path) -> list[tuple]:
    """The commit log's lines as (part, samples, tokens, lengths), in commit order, a part
    committed twice listed twice (a torn last line is not committed)."""
    try:
        lines = (cache / LOG_FILE).read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    records = [decode_log_line(line, f"{cache / LOG_FILE}, line {i + 1}")
               for i, line in enumerate(lines) if line.endswith(b"\n")]
    return [(r.name, r.samples, r.tokens, r.lengths) for r in records]


def verify(cache: Path) -> tuple[int, str]:
    """`dflash-cache verify`'s exit status (0 sound, 1 damaged) and its problems."""
    report = verify_cache(cache, progress=False)
    return (0 if report.ok else 1), "; ".join(map(str, report.problems))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, help="Ranks of the shared and killed runs (one GPU each).")
    ap.add_argument("--shape", choices=("8b", "27b-dense", "27b-hybrid"), default="8b",
                    help="The target's shape (bench_extract.py's) [8b].")
    ap.add_argument("--small", action="store_true", help="The CPU-sized shape, on the CPU (a check of the script).")
    ap.add_argument("--workdir", help="Data, caches and logs (removed at the end unless --keep).")
    ap.add_argument("--tokens-per-gpu", type=int, help="Tokens per rank [262,144; small: 4,096].")
    ap.add_argument("--seq-len", type=int, help="Typical sample length [2,048; small: 128].")
    ap.add_argument("--codec", default="bf16", help="Cache codec [bf16].")
    ap.add_argument("--token-budget", type=int, help="Padded tokens per forward [32,768; small: 1,024].")
    ap.add_argument("--part-tokens", type=int, help="Tokens per part [32,768; small: 512].")
    ap.add_argument("--num-writers", type=int, help="Writer processes per rank [dflash-extract's default].")
    ap.add_argument("--kill-after-parts", type=int,
                    help="Kill the last rank once the cache holds this many parts [the number of ranks].")
    ap.add_argument("--no-kill", action="store_true", help="Skip the killed run.")
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds each run may take [900].")
    ap.add_argument("--keep", action="store_true", help="Keep the workdir.")
    ap.add_argument("--json", help="Also write the figures to this file (bench/gpu_hours.py reads it).")
    ap.add_argument("--rank-spec", help=argparse.SUPPRESS)  # internal: run one rank
    return ap


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    if a.rank_spec:
        rank_main(json.loads(a.rank_spec))
        return
    if not a.gpus or not a.workdir:
        parser.error("--gpus and --workdir are needed.")
    import shutil

    import torch
    from bench_extract import SHAPES, write_data

    device = "cpu" if a.small else "cuda"
    if device == "cuda" and torch.cuda.device_count() < a.gpus:
        raise SystemExit(f"--gpus {a.gpus}: this host has {torch.cuda.device_count()} visible GPU(s). Ask for "
                         "fewer, or run on a host with more.")
    _, full, small = SHAPES[a.shape]
    shape = small if a.small else full
    per_gpu = a.tokens_per_gpu or (4096 if a.small else 1 << 18)
    seq_len = a.seq_len or (128 if a.small else 2048)
    part = a.part_tokens or (512 if a.small else 32768)
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # Sort windows of a quarter of a rank's tokens: every rank gets several whole windows.
    window = max(part, per_gpu // 4)
    base = {"shape": a.shape, "small": a.small, "device": device, "codec": a.codec,
            "label": f"<in-memory {a.shape}-shaped target, seed 0>",
            "token_budget": a.token_budget or (1024 if a.small else 32768), "part_tokens": part,
            "sort_window_tokens": window, "max_seq_len": 2 * seq_len, "num_writers": a.num_writers}
    one, many = work / "data-1.jsonl", work / f"data-{a.gpus}.jsonl"
    write_data(one, per_gpu, seq_len, shape["vocab_size"])
    samples = write_data(many, per_gpu * a.gpus, seq_len, shape["vocab_size"])
    print(f"{a.shape}{' (small, CPU)' if a.small else ''}: {per_gpu:,} tokens per rank (samples of ~{seq_len}), "
          f"parts of {part:,}, sort windows of {window:,}, codec {a.codec}, {a.gpus} ranks", flush=True)
    result = {"bench": "extract-scale", "shape": a.shape, "small": a.small, "gpus": a.gpus, "codec": a.codec,
              "tokens_per_gpu": per_gpu, "prefill_tokens_per_second": None,
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}

    def write_json() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(result) + "\n")

    try:
        single = Ranks("single", work, {**base, "data": str(one), "output": str(work / "cache-single")}, 1, device)
        single.start_all()
        single.wait(a.timeout)
        result["single"] = aggregate(single.figures())
        rate1 = result["single"]["tokens_per_second"]
        print(f"single: {result['single']['tokens']:,} tokens in {result['single']['seconds']:.1f} s, "
              f"{rate1:,.0f} tokens/s", flush=True)
        shutil.rmtree(work / "cache-single", ignore_errors=True)

        shared_cache = work / "cache-shared"
        shared = Ranks("shared", work, {**base, "data": str(many), "output": str(shared_cache)}, a.gpus, device)
        shared.start_all()
        shared.wait(a.timeout)
        agg = aggregate(shared.figures())
        agg["scaling_efficiency"] = agg["tokens_per_second"] / (a.gpus * rate1)
        result["shared"] = agg
        # bench/gpu_hours.py reads the aggregate rate; `gpus` makes its GPU-hours count every GPU.
        result["extract"] = {a.codec: {"tokens_per_second": agg["tokens_per_second"]}}
        print(f"shared: {agg['tokens']:,} tokens in {agg['seconds']:.1f} s, {agg['tokens_per_second']:,.0f} "
              f"tokens/s on {a.gpus} ranks = {agg['scaling_efficiency']:.1%} of {a.gpus} x single (per rank: "
              + ", ".join(f"{r:,.0f}" for r in agg["per_rank_tokens_per_second"]) + ")", flush=True)
        reference = sorted(committed(shared_cache))
        rc, _ = verify(shared_cache)
        result["shared"]["verify_status"] = rc
        shutil.rmtree(shared_cache, ignore_errors=True)
        write_json()

        if not a.no_kill:
            killed_cache = work / "cache-killed"
            victim = a.gpus - 1
            after = a.kill_after_parts or a.gpus
            killed = Ranks("killed", work, {**base, "data": str(many), "output": str(killed_cache)}, a.gpus, device)
            killed.start_all()
            deadline = time.monotonic() + a.timeout
            while len(committed(killed_cache)) < after:
                if killed.procs[victim].poll() is not None:
                    raise SystemExit(f"killed: rank {victim} ended before the cache held {after} parts; "
                                     "lower --kill-after-parts or give each rank more tokens.")
                if time.monotonic() > deadline:
                    raise SystemExit(f"killed: the cache did not reach {after} parts in {a.timeout:.0f} s.")
                time.sleep(0.05)
            killed.kill(victim)
            at_kill = len(committed(killed_cache))
            t = time.monotonic()
            killed.start(victim)
            killed.wait(a.timeout)
            again = killed.figures()[victim]
            parts = sorted(committed(killed_cache))
            rc, report = verify(killed_cache)
            names = [p[0] for p in parts]
            result["killed"] = {
                "rank": victim, "parts_at_kill": at_kill, "resumed_seconds": time.monotonic() - t,
                "resumed_parts_done_before": again["parts_done_before"],
                "resumed_parts_written": again["parts_written"], "parts": len(parts),
                "duplicate_parts": len(names) - len(set(names)), "same_parts_as_shared": parts == reference,
                "samples": sum(p[1] for p in parts), "data_samples": samples, "verify_status": rc}
            k = result["killed"]
            print(f"killed: rank {victim} SIGKILLed at {at_kill} committed parts; rerun skipped "
                  f"{k['resumed_parts_done_before']} of its parts and wrote {k['resumed_parts_written']}; the cache: "
                  f"{k['parts']} parts, {k['duplicate_parts']} duplicated, same parts as the shared run: "
                  f"{k['same_parts_as_shared']}, {k['samples']} of {samples} samples, dflash-cache verify status "
                  f"{rc}", flush=True)
            write_json()
            if not (k["same_parts_as_shared"] and rc == 0 and k["samples"] == samples):
                raise SystemExit(f"killed: the resumed cache is not the shared run's (verify said: {report[-1500:]})")
    finally:
        write_json()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

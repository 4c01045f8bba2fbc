"""Wall time of `--help` of every dflash command (the target: under 1.5 s on a 2-core host).

Each command runs as its console script does (`from MODULE import main; main()`), in a fresh
interpreter, `--runs` times; the script prints the median and the fastest run, and whether the
command loaded torch. `--root DIR` times the code of another checkout of this repository
(e.g. `git worktree add /tmp/old <commit>`): its packages are put first on the path through a
folder of links, so both versions are timed on the same host at the same time.

    python3 bench/bench_help.py
    python3 bench/bench_help.py --root /tmp/old --runs 5
"""

from __future__ import annotations

import argparse
import configparser
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [("dflash-extract", []), ("dflash-train", []), ("dflash-train", ["run"]), ("dflash-train", ["export"]),
            ("dflash-train", ["estimate"]), ("dflash-cache", []), ("dflash-cache", ["verify"]), ("dflash-eval", []),
            ("dflash-demo", []), ("dflash-prepare", []), ("dflash-generate", [])]
RUN = ("import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr))\n"
       "sys.argv[0] = {name!r}; from {module} import {func}; {func}()")


def entry_points(root: Path) -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {name.strip(): target.strip() for name, target in (line.split("=", 1) for line in lines)}


def package_links(root: Path, into: Path) -> Path:
    """A folder whose dflash/<pkg> links point at root's package folders (setup.cfg package_dir)."""
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    (into / "dflash").mkdir(parents=True)
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, folder = (x.strip() for x in line.split("=", 1))
        os.symlink(root / folder, into / "dflash" / name.split(".", 1)[1])
    return into


def time_help(name: str, args: list[str], target: str, env: dict[str, str], runs: int) -> tuple[list[float], bool]:
    module, func = target.split(":")
    code = RUN.format(name=name, module=module, func=func)
    times, loaded_torch = [], False
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code, *args, "--help"], env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{name} {' '.join(args)} --help failed:\n{done.stderr}")
        loaded_torch = done.stderr.strip().splitlines()[-1] == "True"
    return times, loaded_torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose code to time")
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if opts.root.resolve() != ROOT:
            env["PYTHONPATH"] = str(package_links(opts.root.resolve(), Path(tmp)))
        points = entry_points(opts.root)
        print(f"--help of every command, {opts.runs} runs each, code of {opts.root} "
              f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
        print(f"{'command':<28} {'median s':>9} {'min s':>7}  torch")
        for name, args in COMMANDS:
            if name not in points:  # an older checkout (--root) without the command
                continue
            times, torch_loaded = time_help(name, args, points[name], env, opts.runs)
            label = " ".join([name, *args])
            print(f"{label:<28} {statistics.median(times):>9.2f} {min(times):>7.2f}  "
                  f"{'loaded' if torch_loaded else 'not loaded'}")


if __name__ == "__main__":
    main()

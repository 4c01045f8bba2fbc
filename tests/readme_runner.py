"""Runs a list of commands as a shell would, forking each from one pre-imported process.

Importing torch and transformers takes seconds per process; README's commands are a dozen
processes. This driver imports them once, then forks a child per command that runs the real
entry point: a console script (`dflash-train ...`) through its `console_scripts` entry point, as
the installed script does, or `python3 -m MODULE ...` through runpy, as the interpreter does;
each with its own argv, working directory and log file. The driver runs no torch op, so every
child starts as clean as a new interpreter.

Usage: python3 readme_runner.py PLAN.json; PLAN is a list of {"argv": [...], "cwd": DIR,
"log": FILE}. It prints one JSON line per command run, {"index", "status", "seconds"}, and
stops after the first command whose status is not 0.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
import traceback
from importlib.metadata import entry_points


def _child(argv: list[str], cwd: str, log: str) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(cwd)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        try:
            if argv[0] in ("python", "python3") and argv[1] == "-m":
                sys.argv = [argv[2], *argv[3:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                code = 0
            else:
                (script,) = entry_points(group="console_scripts", name=argv[0])
                sys.argv = list(argv)
                result = script.load()()
                code = result if isinstance(result, int) else (0 if result is None else 1)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # as at a normal interpreter exit
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(plan_path: str) -> None:
    import torch  # noqa: F401 - the point of the driver: imported once, shared by every command
    import transformers  # noqa: F401
    from dflash.cache_tools import cli as _cache_cli  # noqa: F401
    from dflash.eval import cli as _eval_cli  # noqa: F401
    from dflash.extract import cli as _extract_cli  # noqa: F401
    from dflash.extract import pipeline as _pipeline  # noqa: F401
    from dflash.prepare import cli as _prepare_cli  # noqa: F401
    from dflash.train import cli as _train_cli  # noqa: F401
    from dflash.train.run import loop as _loop  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - lazy modules

    for index, command in enumerate(json.loads(open(plan_path).read())):
        sys.stdout.flush()
        sys.stderr.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(command["argv"], command["cwd"], command["log"])
        _, raw = os.waitpid(pid, 0)
        status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        print(json.dumps({"index": index, "status": status, "seconds": round(time.monotonic() - start, 2)}),
              flush=True)
        if status != 0:
            break


if __name__ == "__main__":
    main(sys.argv[1])

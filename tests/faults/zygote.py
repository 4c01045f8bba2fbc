"""A pre-imported process that forks fresh runs of the dflash CLIs on request.

Importing torch and transformers takes seconds; the fault campaign starts dozens of runs to
signal or kill them, so it pays for the imports once. Each run is a forked child that executes
the real console entry point (`dflash.extract.cli.main` / `dflash.train.cli.main`) with its own
argv, environment and log file, exactly as `dflash-extract ...` would, in its own process
group. The zygote never runs a torch op, so its children start as clean as a new interpreter.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout:
  {"op": "run", "prog": "extract"|"train", "argv": [...], "env": {...}, "log": PATH} -> {"pid": N}
    (the run's env is set before its code runs; an OMP_NUM_THREADS there sets torch's thread count;
    the slow points it names are installed then: site/fault_points.py)
  {"op": "wait", "pid": N, "timeout": S}  -> {"status": exit status or -signal, or null}
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback


def _child(req: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.update(req.get("env", {}))
        import fault_points  # on PYTHONPATH (Zygote): the slow points this run's env names

        fault_points.install()
        if "OMP_NUM_THREADS" in req.get("env", {}):  # torch read it at import, in the zygote
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        if req["prog"] == "extract":
            from dflash.extract.cli import main
        else:
            from dflash.train.cli import main
        sys.argv = [f"dflash-{req['prog']}", *req["argv"]]
        try:
            main(args=req["argv"], prog_name=sys.argv[0])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:  # what the interpreter does with an uncaught Ctrl-C
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # as at a normal interpreter exit (multiprocessing's cleanup)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve() -> None:
    import torch  # noqa: F401 - the point of the zygote: imported once, shared by every run
    import transformers  # noqa: F401
    from dflash.extract import cli as _extract_cli  # noqa: F401
    from dflash.extract import pipeline as _pipeline  # noqa: F401
    from dflash.train import cli as _train_cli  # noqa: F401
    from dflash.train.run import loop as _loop  # noqa: F401
    from safetensors.torch import load_file  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401 - lazy modules

    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req)
            answer = {"pid": pid}
        elif req["op"] == "wait":
            deadline = time.monotonic() + req["timeout"]
            status = None
            while True:
                done, raw = os.waitpid(req["pid"], os.WNOHANG)
                if done:
                    status = _status(raw)
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            answer = {"status": status}
        else:
            answer = {"error": f"unknown op {req['op']!r}"}
        print(json.dumps(answer), file=out, flush=True)


if __name__ == "__main__":
    serve()

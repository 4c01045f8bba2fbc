"""README.md's commands run as written.

The test reads README.md's ```bash blocks, replaces only the paths of PATHS (every other token
of a command is kept as written) and runs every `dflash-*` command in order, each block in a
directory of its own, asserting exit status 0. The small inputs a command names
(completions.jsonl, chat.jsonl, ...) are written there first; tiny data keeps the trainer's
default run (its epochs and steps) to seconds.

What stands in for /models/Qwen3-8B: a random-init Qwen3 target of 8 layers with a byte-level
tokenizer and Qwen3's chat template, built here. Not the demo's shipped target: its 4 layers are
fewer than the default layer rule (5 captured layers, README's `dflash-extract` line) needs, so
that line is refused there, as test_extract_layer_check_early.py shows, and it has no tokenizer
or chat template for `dflash-prepare`. 8 is the fewest layers the rule takes.

`torchrun --nproc-per-node 8 -m MODULE FLAGS` runs as `python3 -m MODULE FLAGS`: one process,
the same flags (rank 0 of 1). Commands that cannot run here are listed in NOT_RUNNABLE with
the reason; a command of README.md that is neither run nor listed fails the test, so a new one
is either run or given a reason.

Every command runs from one pre-imported process that forks it (tests/readme_runner.py: the
console script's entry point or `python3 -m`'s runpy, as the installed script and the
interpreter run them), which spares a dozen imports of torch.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import make_tiny_target, write_jsonl

README = Path(__file__).resolve().parents[1] / "README.md"
RUNNER = Path(__file__).with_name("readme_runner.py")
STAND_IN_TARGET = "target"  # (under the test's directory)

PATHS = {"/models/Qwen3-8B": STAND_IN_TARGET}
"""Each path of README.md's commands that is not on this machine -> what stands in for it."""

NOT_RUNNABLE = {
    "bash demo.sh": "installs torch and the package with pip (network) and runs the whole demo for "
                    "minutes; tests/test_demo.py runs dflash-demo itself",
    "python3 -m pytest": "the test suite this test is part of",
    "vllm serve": "an inference server on a GPU",
    "--server": "needs a running inference server (vllm serve above)",
}
"""Commands (by their first words, or a flag they carry) not run here, with the reason."""

STAND_INS = {
    "dflash-generate": "dflash-prepare",
}
"""A command not runnable here -> the command that writes its output instead, with the flags both
take (dflash-prepare renders the dataset's own answers where dflash-generate regenerates them
with the target behind --server), so that the commands after it have their input."""

TORCHRUN_FLAGS = {"--nproc-per-node"}
"""torchrun's flags that README.md uses (each with a value); dropped when it runs on one process."""


@dataclass
class Command:
    block: int
    written: str  # as README.md writes it
    argv: list[str] | None  # what runs (None: not run)
    reason: str = ""  # why it is not run as written, or what changed


def readme_commands(text: str) -> list[Command]:
    """Every command of README.md's ```bash blocks: its argv with PATHS replaced, or its reason."""
    commands = []
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    for block, body in enumerate(blocks):
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            for part in _split_on(tokens, "&&"):
                if part and part[-1] == "&":  # (in the background: the server of the chat block)
                    part = part[:-1]
                if part:
                    commands.append(_classify(block, part))
    return commands


def _split_on(tokens: list[str], sep: str) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for t in tokens:
        if t == sep:
            out.append([])
        else:
            out[-1].append(t)
    return out


def _classify(block: int, tokens: list[str]) -> Command:
    written = shlex.join(tokens)
    strange = [t for t in tokens if t in ("|", ";", ">", "<") or "$" in t or "`" in t]
    assert not strange, f"README.md: `{written}` uses shell syntax this test does not run ({strange})"
    for words, reason in NOT_RUNNABLE.items():
        if words.startswith("--") and words in tokens or written.startswith(words):
            stand_in = STAND_INS.get(tokens[0])
            if stand_in:
                return Command(block, written, _stand_in_argv(stand_in, tokens),
                               f"{reason}; {stand_in} writes its output instead")
            return Command(block, written, None, reason)
    reason = ""
    if tokens[0] == "torchrun":
        module = tokens.index("-m")
        flags = tokens[1:module]
        assert all(f in TORCHRUN_FLAGS for f in flags[::2]), f"README.md: torchrun flags {flags} are new here"
        tokens = ["python3", "-m", *tokens[module + 1:]]
        reason = "one process under python3 -m, torchrun's flags dropped"
    assert tokens[0].startswith("dflash-") or tokens[:3] == ["python3", "-m", tokens[2]] and tokens[2].startswith(
        "dflash."), f"README.md: `{written}` is neither a dflash command nor listed in NOT_RUNNABLE"
    return Command(block, written, [_path(t) for t in tokens], reason)


def _stand_in_argv(command: str, tokens: list[str]) -> list[str]:
    kept = ("--target-model", "--data", "--output", "--thinking")
    argv = [command]
    for flag in kept:
        if flag in tokens:
            argv += [flag, _path(tokens[tokens.index(flag) + 1])]
    return argv


def _path(token: str) -> str:
    if token in PATHS:
        return PATHS[token]
    assert not token.startswith("/"), f"README.md names {token}: add what stands in for it to PATHS"
    return token


# -- the inputs the commands name -------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    vocab = ["the", "drafter", "reads", "target", "layers", "a", "cache", "of", "block", "tokens", "and", "runs"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def write_inputs(directory: Path) -> None:
    """completions.jsonl, prompts.jsonl, chat.jsonl and eval_chat.jsonl, small enough that the
    trainer's default run (10 epochs of one step each) takes seconds on a CPU."""
    rng = random.Random(0)
    completions = []
    for i in range(12):
        ids = list(_text(rng, rng.randint(4, 7)).encode())  # byte ids: the stand-in's tokenizer
        completions.append({"id": f"c{i}", "input_ids": ids, "prompt_len": len(ids) // 3})
    write_jsonl(directory / "completions.jsonl", completions)
    write_jsonl(directory / "prompts.jsonl", [{"input_ids": list(_text(rng, 3).encode())} for _ in range(2)])

    def chats(n: int) -> list[dict]:
        return [{"messages": [{"role": "user", "content": _text(rng, 3)},
                              {"role": "assistant", "content": _text(rng, 4)}]} for _ in range(n)]

    write_jsonl(directory / "chat.jsonl", chats(8))
    write_jsonl(directory / "eval_chat.jsonl", chats(2))


def make_stand_in_target(path: Path) -> Path:
    from chat_utils import QWEN3_TEMPLATE, VOCAB_SIZE, make_tokenizer

    tok = make_tokenizer(path, QWEN3_TEMPLATE)
    return make_tiny_target(path, family="qwen3", hidden=32, layers=8, vocab=VOCAB_SIZE, heads=4, kv_heads=2,
                            head_dim=8, max_positions=1024, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)


# -- the tests --------------------------------------------------------------------------------


def test_every_readme_command_is_run_or_given_a_reason():
    text = README.read_text()
    for path in PATHS:
        assert path in text, f"PATHS names {path}, which README.md no longer uses"
    commands = readme_commands(text)
    run = [c for c in commands if c.argv]
    assert {c.argv[0] for c in run} >= {"dflash-extract", "dflash-cache", "dflash-train", "dflash-eval",
                                        "dflash-prepare"}
    assert any(c.argv[:3] == ["python3", "-m", "dflash.train.cli"] for c in run)  # a torchrun line
    assert all(c.reason for c in commands if not c.argv)


@pytest.mark.slow  # a dozen forked runs of the commands (about 30 s on a CPU core)
def test_readme_commands_run_as_written(tmp_path):
    commands = readme_commands(README.read_text())
    make_stand_in_target(tmp_path / STAND_IN_TARGET)
    plan = []
    for c in commands:
        if c.argv is None:
            continue
        cwd = tmp_path / f"block-{c.block}"
        if not cwd.exists():
            cwd.mkdir()
            (cwd / STAND_IN_TARGET).symlink_to(tmp_path / STAND_IN_TARGET)
            write_inputs(cwd)
        plan.append({"argv": c.argv, "cwd": str(cwd), "log": str(tmp_path / f"log-{len(plan):02d}.txt"), "command": c})
    (tmp_path / "plan.json").write_text(json.dumps([{k: v for k, v in p.items() if k != "command"} for p in plan]))
    done = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "plan.json")], capture_output=True,
                          text=True, timeout=300)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    for result in results:
        step = plan[result["index"]]
        c = step["command"]
        assert result["status"] == 0, (
            f"README.md block {c.block}: `{c.written}` (run as `{shlex.join(c.argv)}` in {step['cwd']}"
            f"{'; ' + c.reason if c.reason else ''}) exited {result['status']}:\n"
            + Path(step["log"]).read_text()[-4000:])
    assert len(results) == len(plan)
    for block in {p["command"].block for p in plan if p["command"].argv[0] == "dflash-extract"}:
        assert (tmp_path / f"block-{block}" / "cache" / "manifest.json").is_file()
    card = next(tmp_path / f"block-{p['command'].block}" / "run" / "final" / "README.md" for p in plan
                if "--update-card" in p["command"].argv)
    assert "prompts (2)" in card.read_text()  # --update-card's figures for prompts.jsonl's 2 prompts

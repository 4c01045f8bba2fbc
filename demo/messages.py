"""What dflash.demo tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import renders


@renders("demo.workdir-is-file", example=dict(dir="dflash-demo"))
def _workdir_is_file(dir):
    return f"--workdir {dir} is a file, not a directory. Pass an empty or new --workdir."


@renders("demo.workdir-not-a-demo", example=dict(dir="here", holds=["notes.txt", "src/"], marker=".dflash-demo"))
def _workdir_not_a_demo(dir, holds, marker):
    shown = ", ".join(holds[:5]) + (f" and {len(holds) - 5} more" if len(holds) > 5 else "")
    return (f"--workdir {dir} is not empty and is not a dflash-demo work directory (it holds {shown}, and no "
            f"{marker} file that a demo leaves there): the demo replaces its target/, cache/, run/ and "
            "completions.jsonl in its work directory, so it would delete files that are not its own. Pass an "
            "empty or new --workdir (the default is ./dflash-demo).")


@renders("demo.character-outside-alphabet", example=dict(character="é"))
def _character_outside_alphabet(character):
    return f"character {character!r} is not in the demo's alphabet."


@renders("demo.corpus-missing", example=dict(file="demo/data/corpus.txt"))
def _corpus_missing(file):
    return f"the demo corpus {file} is missing; reinstall the package (it ships data/)."


@renders("demo.vocab-below-alphabet", example=dict(vocab_size=16, alphabet=40))
def _vocab_below_alphabet(vocab_size, alphabet):
    return f"vocab_size {vocab_size} is below the alphabet's {alphabet} ids."


@renders("demo.stage-failed", example=dict(stage="dflash-extract", status=2, log="dflash-demo/extract.log"))
def _stage_failed(stage, status, log):
    return f"{stage} failed with status {status}; the last lines of its log are above, the whole log is {log}."


# -- dflash-demo's contract (demo/cli.py: runtime.cli's stop finding) ---------------------------


@renders("demo.stopped", example=dict(command="dflash-demo", signal="SIGINT"))
def _stopped(command, signal):
    return f"{command} stopped by {signal}; rerun it to start the demo again (each stage rewrites its outputs)."

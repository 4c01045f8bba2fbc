"""How much text the benchmark's training prompts are cut from: the drafter's data diversity.

The generate stage cuts its completions' prompts from the drafter's prompt files (prompt_percent
of the training files, never seen by the target), each at a line start of a file picked in
proportion to its tokens. This script cuts exactly those prompts (the same seeds, lengths and
batches, no model) and prints how many prompt files and tokens they come from, how many of the
prompts are distinct, and how many prompts hold each prompt-file token on average:

    python3 bench/quality/prompt_pool.py --domain prose --set completions=32768

Learning the BPE vocabulary of a domain takes a few seconds (prose) to a minute (code) on two
cores; WORKDIR (default a temporary directory) keeps the encoded corpus for a rerun.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import apply_overrides  # noqa: E402
from stages import PromptPool, Work, batch_size, cut_batch, preset  # noqa: E402


def prompt_pool(work: Work) -> dict[str, float]:
    s = work.sizes
    _, prompt_files = work.split_training()
    pool = PromptPool(sum(len(e.tokens) for e in prompt_files))
    every: collections.Counter = collections.Counter()
    greedy: set = set()
    greedy_total = 0
    for b in range(-(-s.completions // batch_size(s))):
        prompts = cut_batch(s, prompt_files, b)
        pool.add(prompts)
        every.update(tuple(p) for p in prompts)
        if b % 2 == 0:  # even batches are the greedy ones
            greedy.update(tuple(p) for p in prompts)
            greedy_total += len(prompts)
    r = pool.record()
    return {**r, "prompt_files": len(prompt_files), "prompts": pool.prompts,
            "distinct_share": r["distinct_prompts"] / pool.prompts, "greedy_prompts": greedy_total,
            "distinct_greedy": len(greedy), "most_repeated": every.most_common(1)[0][1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", default="code", choices=("code", "prose"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="Change one of the sizes (see stages.Sizes), as bench/quality/run.py takes them.")
    ap.add_argument("--workdir", help="Where the encoded corpus is kept (default: a temporary directory).")
    a = ap.parse_args(argv)
    sizes = apply_overrides(preset(a.domain), a.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        r = prompt_pool(Work(root, sizes, "cpu"))
    print(f"{a.domain}, {r['prompts']:,} completions: {r['prompt_files']} prompt files of "
          f"{r['prompt_file_tokens']:,} tokens; {r['distinct_prompts']:,} distinct prompts "
          f"({r['distinct_share']:.1%}), {r['distinct_greedy']:,} of the {r['greedy_prompts']:,} greedy ones; "
          f"{r['prompts_per_file_token']:.1f} prompts hold each prompt-file token on average; "
          f"the most repeated prompt {r['most_repeated']} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())

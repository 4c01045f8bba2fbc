"""Write corpus.txt, the demo's training text: short documents of templated English, small
arithmetic, counting and code-like lines, separated by blank lines.

Everything is generated from a fixed seed, so the file is reproducible:
`python make_corpus.py > corpus.txt`. The text is made up by this script (no outside source).
"""

from __future__ import annotations

import random

ADJECTIVES = ["red", "quick", "lazy", "small", "old", "green", "happy", "quiet", "brave", "tall"]
ANIMALS = ["fox", "dog", "cat", "owl", "bear", "wolf", "horse", "mouse", "duck", "frog"]
VERBS = ["jumps over", "runs past", "looks at", "sleeps near", "walks to", "sings for"]
PLACES = ["the river", "the old mill", "the green hill", "the quiet town", "the dark wood"]
NAMES = ["anna", "ben", "carl", "dora", "emil", "fay", "gus", "hana"]
ITEMS = ["apples", "books", "coins", "eggs", "pens", "shells", "stones", "cups"]
OPS = {"add": "+", "sub": "-", "mul": "*"}


def story(r: random.Random) -> list[str]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    n = r.randint(2, 9)
    lines = [
        f"the {r.choice(ADJECTIVES)} {r.choice(ANIMALS)} {r.choice(VERBS)} the {r.choice(ADJECTIVES)} {r.choice(ANIMALS)}.",
        f"{name} walks to {r.choice(PLACES)} with {n} {item}.",
        f"{name} gives one to the {r.choice(ANIMALS)}, so {name} has {n - 1} {item} left.",
    ]
    if r.random() < 0.5:
        lines.append(f"then the {r.choice(ANIMALS)} {r.choice(VERBS)} {r.choice(PLACES)}.")
    return lines


def arithmetic(r: random.Random) -> list[str]:
    a = r.randint(1, 20)
    op = r.choice(list(OPS))
    lines = []
    for b in range(1, r.randint(4, 7)):
        value = {"add": a + b, "sub": a - b, "mul": a * b}[op]
        lines.append(f"{a} {OPS[op]} {b} = {value}")
    return lines


def counting(r: random.Random) -> list[str]:
    start, step = r.randint(0, 30), r.choice([1, 2, 3, 5, 10])
    words = " ".join(str(start + i * step) for i in range(r.randint(6, 10)))
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = r.randint(0, 18)
    return [f"count from {start} by {step}: {words}", f"letters: {' '.join(letters[i:i + r.randint(5, 8)])}"]


def code(r: random.Random) -> list[str]:
    name, k = r.choice(["total", "score", "count", "size"]), r.randint(2, 9)
    n = r.randint(3, 12)
    return [
        f"def add_{k}(x):",
        f"    return x + {k}",
        f"{name} = 0",
        f"for i in range({n}):",
        f"    {name} = add_{k}({name})",
        f"print({name})  # {n * k}",
    ]


def main(num_documents: int = 2600, seed: int = 0) -> None:
    r = random.Random(seed)
    kinds = [story, arithmetic, counting, code]
    docs = ["\n".join(r.choice(kinds)(r)) for _ in range(num_documents)]
    print("\n\n".join(docs))


if __name__ == "__main__":
    main()

"""Makes `demo/data/target/`, the target the demo ships: `train_target` at the default sizes, seed 0.

    python demo/data/make_target.py [--from WORKDIR/target]

Without `--from` it trains the target (a few minutes on 2 cores); with it, it ships a target an
earlier `dflash-demo --train-target --workdir WORKDIR` (default sizes, seed 0) trained and saved.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from dflash.demo import pipeline as demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="a target dflash-demo --train-target saved")
    parser.add_argument("--final-loss", type=float, help="its last training loss (from its demo_report.json)")
    args = parser.parse_args()
    sizes, seed = demo.DemoSizes(), 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.source is None:
            documents = demo.load_documents()
            held_out = documents[-max(sizes.eval_prompts, len(documents) // 20):]
            train_docs = documents[: len(documents) - len(held_out)]
            random.Random(seed).shuffle(train_docs)
            source = Path(tmp) / "target"
            _, loss = demo.prepare_target(source, train_docs, sizes, seed, train_anew=True)
        else:
            source, loss = args.source, args.final_loss
            if loss is None:
                parser.error("--from needs --final-loss (target_final_loss in the demo's report)")
        shutil.rmtree(demo.SHIPPED_TARGET, ignore_errors=True)
        shutil.copytree(source, demo.SHIPPED_TARGET)
    info = {"seed": seed, "sizes": {k: asdict(sizes)[k] for k in demo.TARGET_SIZE_FIELDS}, "final_loss": loss,
            "made_by": f"demo/data/make_target.py (demo.train_target), torch {torch.__version__}"}
    (demo.SHIPPED_TARGET / demo.SHIPPED_TARGET_INFO).write_text(json.dumps(info, indent=1) + "\n")
    print(f"shipped target written to {demo.SHIPPED_TARGET} (last loss {loss:.3f})")


if __name__ == "__main__":
    main()

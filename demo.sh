#!/usr/bin/env bash
# The embedded demo: install the package and run the whole pipeline on CPU (a few minutes on 2
# cores after the install, docs/BENCHMARKS.md; no network besides the install): the small target the package ships
# (`--train-target` trains it anew on the shipped corpus), its completions, dflash-extract,
# dflash-train, dflash-eval beside prompt lookup. Extra arguments go to dflash-demo,
# e.g. `bash demo.sh --workdir /tmp/demo` or `bash demo.sh --small`.
set -euo pipefail
cd "$(dirname "$0")"
# Keep a torch that is already installed (e.g. a CUDA build); else take the pinned release.
python3 -c "import torch" 2>/dev/null || python3 -m pip install torch==2.13.0
python3 -m pip install -e ".[dev]"
dflash-demo "$@"

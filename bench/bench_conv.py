"""DFlash2's in-block convolutions as written at other revisions, side by side in one process: one
pair of `GroupedDynamicConv` around a linear (the input convolution, the sublayer, the output
convolution, as a draft layer runs them), forward and backward in bf16, compiled and eager, each
revision's train/heads/dflash2/modules.py (`git show REV:...`; `worktree`: the file as it is now)
loaded as a module of its own. The revisions take turns, round after round, so that a slow spell of
a shared GPU falls on all of them; each figure is the median over the rounds of each round's median.
The revisions' outputs and input gradients are checked against the first's before any is timed (the
norm of the difference under 2 % of theirs).

Shapes (tokens x hidden, blocks of 16): the quality benchmark's small drafter (162,816 x 384, the
10,176 blocks of a step) and the 8B one (8,192 x 4,096, 512 anchors).

    python bench/bench_conv.py --revs d2f2984,worktree               # one GPU: both shapes
    python bench/bench_conv.py --revs HEAD --tokens 512 --hidden 64   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MODULES = "train/heads/dflash2/modules.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import report_rows, timed  # noqa: E402


def load(rev: str, scratch: Path):
    """The modules file of `rev` as a module of its own (`worktree`: the file on disk)."""
    path = REPO / MODULES
    if rev != "worktree":
        path = scratch / f"{rev.replace('/', '_')}.py"
        path.write_text(subprocess.run(["git", "show", f"{rev}:{MODULES}"], cwd=REPO, check=True,
                                       capture_output=True, text=True).stdout)
    name = f"bench_conv_{len(sys.modules)}"  # a name of its own, free of the revision's punctuation
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile looks the module up by name
    spec.loader.exec_module(module)
    return module


def pair(module, hidden: int, device: torch.device):
    """forward(x): the two convolutions of one sublayer around a linear, the same weights at every revision."""
    torch.manual_seed(0)
    conv = module.GroupedDynamicConv(hidden, 2, 16).to(device, torch.bfloat16)
    sublayer = torch.nn.Linear(hidden, hidden, bias=False).to(device, torch.bfloat16)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_(std=0.02)
        conv.base_kernel.normal_()

    def forward(x):
        y, delta = conv.prepare(x, 16)
        return conv.finish(sublayer(y), delta, 16)
    return forward


def measure(revs: list[str], tokens: int, hidden: int, device: torch.device, rounds: int, repeats: int,
            scratch: Path) -> list[dict]:
    modules = {rev: load(rev, scratch) for rev in revs}
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    upstream = torch.randn(1, tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    out = []
    for mode in ("compiled", "eager"):
        steps, first = {}, None
        for rev, module in modules.items():
            forward = pair(module, hidden, device)
            forward = torch.compile(forward) if mode == "compiled" else forward

            def step(forward=forward):
                x.grad = None
                forward(x).backward(upstream)
            step()
            if first is None:
                first = (forward(x).detach(), x.grad.clone())
            else:
                for a, b in zip(first, (forward(x).detach(), x.grad)):
                    # relative to the whole tensor's size: paths that round differently (bf16 products
                    # against float32 sums in a kernel) differ by a bf16 ulp here and there: 0.03 % of
                    # the elements past 2e-2 at the small drafter's shape on an H100 and on the CPU
                    # alike, under 1 % of the norm; a tap that reads another token is off by the whole norm
                    a, b = a.float(), b.float()
                    off = float((b - a).norm() / a.norm())
                    assert off < 2e-2, (f"{rev} computes other values than {revs[0]}: the difference's norm is "
                                        f"{off:.3g} of theirs")
            steps[rev] = step
        medians = {rev: [] for rev in revs}
        for _ in range(rounds):
            for rev, step in steps.items():
                medians[rev].append(timed(step, device, repeats))
        base = statistics.median(medians[revs[0]])
        for rev in revs:
            ms = statistics.median(medians[rev])
            out.append({"tokens": tokens, "hidden": hidden, "mode": mode, "rev": rev, "ms": ms,
                        "vs_first": ms / base})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revs", default="worktree",
                        help="comma-separated git revisions (or `worktree`); figures relative to the first")
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the one shape to run (default: both above)")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size of the one shape of --tokens (a multiple of 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a revision takes in each round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file (JSON lines)")
    a = parser.parse_args()
    device = torch.device(a.device)
    revs = [r for r in a.revs.split(",") if r]
    shapes = [(a.tokens, a.hidden)] if a.tokens else [(10_176 * 16, 384), (512 * 16, 4096)]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(revs))
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for tokens, hidden in shapes:
            for r in measure(revs, tokens, hidden, device, a.rounds, a.repeats, Path(scratch)):
                results.append(r)
                print(f"{r['tokens']:>7} x {r['hidden']:>5} {r['mode']:>8}  {r['rev']:<12} {r['ms']:9.3f} ms  "
                      f"{r['vs_first']:.3f}x {revs[0]}", flush=True)
    report_rows("conv", device, results, a.json)

if __name__ == "__main__":
    main()

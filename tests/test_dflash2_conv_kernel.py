"""DFlash2's in-block convolution as Triton kernels (train/heads/dflash2/conv_triton.py): the same
output and gradients as the expression (modules._InBlockConv), eager and compiled, run here through
Triton's interpreter on the CPU (the kernels' timings are measured on a GPU: bench/bench_conv.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import torch
from dflash.train.heads.dflash2 import conv_triton

# Run in a process of its own: Triton reads TRITON_INTERPRET when the kernels are defined (at import).
SCRIPT = textwrap.dedent("""
    import json, torch
    from dflash.train.heads.dflash2 import conv_triton, modules

    def errors(out, ref):
        return [float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))
                for a, b in zip(out, ref)]

    rows = []
    torch.manual_seed(0)
    # (batch, tokens, hidden, group, taps, block): a partial last block, three taps, one tap, a hidden
    # size past a tile; each channel tile the GPU's autotuner may pick
    cases = [(2, 48, 64, 16, 2, 16), (2, 20, 32, 8, 2, 16), (1, 40, 192, 16, 3, 8), (1, 24, 16, 4, 1, 8)]
    import triton
    for (batch, length, hidden, group, taps, block), tile in [(c, t) for c in cases for t in (64, 128, 256)]:
        for kernel in (conv_triton._forward_kernel, conv_triton._backward_kernel):
            kernel.configs = [triton.Config({"BC": tile})]
        groups = hidden // group
        x = torch.randn(batch, length, groups, group, requires_grad=True)
        delta = torch.randn(batch, length, 2, taps, groups)[..., 1, :, :].detach().requires_grad_(True)
        base = torch.randn(taps, groups, group, requires_grad=True)
        grad = torch.randn(batch, length, groups, group)
        inputs = (x, delta, base)
        ref = modules._InBlockConv.apply(x, delta, base, block)
        ref = (ref, *torch.autograd.grad(ref, inputs, grad))
        out = conv_triton.in_block_conv(x, delta, base, block)
        out = (out, *torch.autograd.grad(out, inputs, grad))
        rows.append({"case": [batch, length, hidden, group, taps, block, tile], "errors": errors(out, ref)})

    # a draft layer's pair around a linear, compiled, against the expression (DFLASH_CONV_KERNEL=torch)
    import os
    calls = []
    kernel = conv_triton.in_block_conv
    conv_triton.in_block_conv = lambda *a: calls.append(1) or kernel(*a)
    conv = modules.GroupedDynamicConv(64, 2, 16)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_(std=0.1)
        conv.base_kernel.normal_()
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(2, 64, 64, requires_grad=True)
    grad = torch.randn(2, 64, 64)

    def pair(x):
        y, delta = conv.prepare(x, 16)
        return conv.finish(linear(y), delta, 16)

    results = {}
    for name, kernel_env, fn in (("expression", "torch", pair), ("kernels", "triton", torch.compile(pair))):
        os.environ["DFLASH_CONV_KERNEL"] = kernel_env
        x.grad = None
        conv.zero_grad()
        y = fn(x)
        y.backward(grad)
        results[name] = (y, x.grad, conv.base_kernel.grad, conv.kernel_projection.weight.grad)
    print(json.dumps({"rows": rows, "compiled": errors(results["kernels"], results["expression"]),
                      "kernel_calls": len(calls)}))
""")


def test_the_kernels_compute_the_expressions_output_and_gradients():
    env = {**os.environ, "TRITON_INTERPRET": "1", "DFLASH_CONV_KERNEL": "triton"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["rows"]) == 12
    for row in found["rows"]:  # output, d x, d delta, d base: float32 sums in another order
        assert all(e < 1e-5 for e in row["errors"]), row
    assert all(e < 1e-5 for e in found["compiled"]), found["compiled"]
    assert found["kernel_calls"] == 2  # the compiled pair ran both convolutions through the kernels


def test_the_kernels_serve_cuda_tensors_with_power_of_two_groups_when_asked_for(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DFLASH_CONV_KERNEL", raising=False)
    cuda = types.SimpleNamespace(is_cuda=True)  # what `available` reads of a CUDA tensor
    assert not conv_triton.available(cuda, 16)  # not asked for: the compiled expression
    monkeypatch.setenv("DFLASH_CONV_KERNEL", "triton")
    assert conv_triton.available(cuda, 16)
    assert not conv_triton.available(torch.zeros(1, 16, 4, 16), 16)  # a CPU tensor: the expression
    assert not conv_triton.available(cuda, 12)  # a group Triton's tiles cannot hold

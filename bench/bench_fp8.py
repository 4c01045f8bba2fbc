"""What the fp8 and nf4 codecs cost on the GPU per extraction batch: each quantizer (eager and
fused by torch.compile) alone, and the stop-after-last-layer forward with each encoding, timed
with CUDA events on a Qwen3-8B-shaped model (random init) and one 32K-token batch.

    python bench/bench_fp8.py
"""

from __future__ import annotations

import time

import torch
from bench_extract import FULL, build_model
from dflash.extract.codecs import quantize_fp8, quantize_nf4_rows
from dflash.extract.engine import _compiled_quantizer
from dflash.extract.target import LayerCapture


def gpu_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    device = torch.device("cuda")
    layers, hidden, tokens = 5, FULL["hidden_size"], 30720
    t = time.perf_counter()
    compiled = _compiled_quantizer(device, [(layers, hidden)])
    print(f"compile: {time.perf_counter() - t:.1f} s ({'fused' if compiled is not quantize_fp8 else 'eager fallback'})")
    x = torch.randn(tokens, layers * hidden, device=device, dtype=torch.bfloat16)
    x[:, 17] *= 40  # an outlier channel
    eager_ms = gpu_ms(lambda: quantize_fp8(x, layers))
    fused_ms = gpu_ms(lambda: compiled(x, layers))
    q1, s1 = quantize_fp8(x, layers)
    q2, s2 = compiled(x, layers)
    print(f"quantizer on [{tokens}, {layers * hidden}] bf16: eager {eager_ms:.1f} ms, fused {fused_ms:.1f} ms; "
          f"bytes differing {(q1 != q2).float().mean().item():.2e}, scales max diff {(s1 - s2).abs().max().item():.2e}")

    t = time.perf_counter()
    nf4 = _compiled_quantizer(device, [(layers, hidden)], quantize_nf4_rows)
    print(f"nf4 compile: {time.perf_counter() - t:.1f} s ({'fused' if nf4 is not quantize_nf4_rows else 'eager fallback'})")
    n1, n2 = quantize_nf4_rows(x, layers)[0], nf4(x, layers)[0]
    print(f"nf4 quantizer: eager {gpu_ms(lambda: quantize_nf4_rows(x, layers)):.1f} ms, fused "
          f"{gpu_ms(lambda: nf4(x, layers)):.1f} ms; bytes differing {(n1 != n2).float().mean().item():.2e}")

    model = build_model(FULL, device)
    capture = LayerCapture(model, [1, 9, 17, 25, 33], need_last=False)
    ids = torch.randint(0, FULL["vocab_size"], (15, 2048), device=device)

    def forward(encode):
        cap = capture(ids, None)
        packed = torch.cat([h.reshape(-1, h.shape[-1]) for h in cap.layers], dim=1)
        return encode(packed)

    with torch.inference_mode():
        rows = [("forward + bf16 (no encoding)", gpu_ms(lambda: forward(lambda p: p.view(torch.int16)))),
                ("forward + fp8 eager", gpu_ms(lambda: forward(lambda p: quantize_fp8(p, layers)))),
                ("forward + fp8 fused", gpu_ms(lambda: forward(lambda p: compiled(p, layers)))),
                ("forward + nf4 fused", gpu_ms(lambda: forward(lambda p: nf4(p, layers))))]
    for name, ms in rows:
        print(f"{name:32s} {ms:8.1f} ms per 30,720-token batch ({ms / rows[0][1]:.3f}x)")


if __name__ == "__main__":
    main()

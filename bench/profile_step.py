"""One training step of the drafter (compute_loss, backward, AdamW), section by section, without the
trainer: DFlash and DFlash2 side by side in one process, on the same batch, and what each part of
DFlash2 costs.

Builds drafters of a bench_train shape from random target tensors and a synthetic batch (a prompt,
then the completion, as bench_train's cache) and times `--steps` steps of each variant:

- `dflash`, `dflash2`: the two drafters; their step times and fractions of the bf16 peak (model
  FLOPs as bench_train counts them; the step without the loader, so a little above bench_train's);
- `dflash2-noconv`: DFlash2 with its in-block convolutions taken out (the selector kept), so that
  `dflash2 - dflash2-noconv` is what the convolutions cost (compiled with the layers around them,
  where they are fused into their neighbours' kernels: no profiler range can say it) and
  `dflash2-noconv - dflash` what the selector's head part costs: of it the top-K and the selector's
  forward are timed in the step (CUDA events around them), the rest is the selector's backward (the
  codebooks' gradients, the candidates' gradient into the logits') and its optimizer step.

Each variant's phases (step, forward, backward, optimizer) are also printed as their fastest, median
and slowest step, so that a step slower than the others shows in which phase it was.

    python bench/profile_step.py --shape 8b --compile                   # one GPU: 8B shape, 3 variants
    python bench/profile_step.py --shape quality-bpe --compile          # the BPE benchmark's small drafter
    python bench/profile_step.py --shape small --steps 2                # a CPU smoke run
    python bench/profile_step.py --shape 8b --variants dflash2 --profile   # torch.profiler's top operators
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import torch
from bench_train import BATCH, LAYER_IDS, PEAK_FLOPS, PROMPT, SHAPES, flops_per_sample

VARIANTS = ("dflash", "dflash2", "dflash2-noconv")


def build(a: argparse.Namespace, variant: str):
    from dflash.train.model.drafter import DFlashDrafter
    from dflash.train.model.drafter_config import DrafterConfig
    from dflash.train.model.target_weights import TargetWeights

    s = SHAPES[a.shape]
    if a.vocab:
        s = dataclasses.replace(s, vocab=a.vocab)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    weights = TargetWeights(embed_tokens=torch.randn(s.vocab, s.hidden, generator=g).to(torch.bfloat16),
                            lm_head=(torch.randn(s.vocab, s.hidden, generator=g) / s.hidden**0.5).to(torch.bfloat16))
    config = DrafterConfig(
        hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        intermediate_size=s.intermediate, vocab_size=s.vocab, num_target_layers=s.target_layers,
        num_hidden_layers=s.draft_layers, target_layer_ids=LAYER_IDS[s.target_layers], block_size=s.block_size,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960,
        attention_backend=a.attention_backend or ("flex" if device.type == "cuda" else "sdpa"),
        mask_token_id=s.vocab - 1, drafter_type="dflash" if variant == "dflash" else "dflash2")
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, weights)
    if a.dtype == "fp32":  # the trainer's frozen tensors follow the training dtype's (bf16 under autocast)
        drafter.embed_weight, drafter.lm_head_weight = drafter.embed_weight.float(), drafter.lm_head_weight.float()
    if variant == "dflash2-noconv":
        for layer in drafter.layers:  # the sublayers run unwrapped
            layer.wrappers = {}
    drafter = drafter.to(device).train()
    samples = a.samples or BATCH[a.shape]
    width = len(LAYER_IDS[s.target_layers]) * s.hidden
    mask = torch.ones(samples, s.seq_len, dtype=torch.long)
    mask[:, : int(s.seq_len * PROMPT[a.shape])] = 0
    g = torch.Generator().manual_seed(1)
    batch = {"hidden": torch.randn(samples, s.seq_len, width, generator=g).to(torch.bfloat16),
             "input_ids": torch.randint(0, s.vocab - 1, (samples, s.seq_len), generator=g),
             "loss_mask": mask, "lengths": torch.full((samples,), s.seq_len)}
    return s, drafter, {k: v.to(device) for k, v in batch.items()}


class PartTimer:
    """Device time of the calls to the DFlash2 head parts the objective makes (CUDA events, or the
    wall time on a CPU), by part, over the timed steps."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pending, self.totals = device, [], {}

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            if self.device.type != "cuda":
                start = time.perf_counter()
                out = fn(*args, **kw)
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kw)
            end.record()
            self.pending.append((name, start, end))
            return out
        return timed

    def collect(self) -> dict[str, float]:
        for name, start, end in self.pending:
            end.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self.pending = []
        return self.totals


def run_variant(a: argparse.Namespace, variant: str) -> dict:
    import dflash.train.loss.objective as objective_module
    from dflash.train.data.anchors import add_anchors
    from dflash.train.loss.objective import ObjectiveConfig, compute_loss

    s, drafter, batch = build(a, variant)
    if a.compile:
        drafter.compile_training()
    device = batch["hidden"].device
    objective = ObjectiveConfig(max_anchors=s.anchors)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if a.dtype == "bf16"
                else torch.autocast(device.type, enabled=False))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(seed: int) -> dict[str, float]:
        # the anchors, as the trainer's loader draws them (in a worker, not timed here)
        anchored = add_anchors(dict(batch), s.anchors, drafter.config.block_size, torch.Generator().manual_seed(seed))
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        with autocast:
            out = compute_loss(drafter, anchored, objective)
        sync()
        forward = time.perf_counter()
        out.loss.backward()
        sync()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        end = time.perf_counter()
        return {"forward_s": forward - start, "backward_s": backward - forward, "optimizer_s": end - backward,
                "step_s": end - start, "step_cpu_s": time.process_time() - cpu, "blocks": int(out.anchor_valid.sum())}

    step(0)  # warm-up (and the compile)
    step(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer = PartTimer(device)
    # the parts timed where the step looks them up (the head's modules are read at call time)
    import dflash.train.heads.dflash2.modules as dflash2_modules
    import dflash.train.loss.head_loss as head_loss_module
    originals = {(module, name): getattr(module, name)
                 for module, name in ((objective_module, "exact_topk"), (head_loss_module, "exact_topk"),
                                      (dflash2_modules, "selector_objective")) if hasattr(module, name)}
    proposed: list[torch.Tensor] = []  # the top-K ids of the timed steps (how spread the candidates are)

    def recording(fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            proposed.append(out[1].detach().reshape(-1, out[1].shape[-1]))
            return out
        return call

    if variant != "dflash":
        for (module, name), fn in originals.items():
            setattr(module, name, timer.wrap(name, recording(fn) if name == "exact_topk" else fn))
    try:
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                runs = [step(2 + i) for i in range(a.steps)]
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=30), flush=True)
        else:
            runs = [step(2 + i) for i in range(a.steps)]
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    # each phase's fastest, median and slowest step: a step slower than the others shows in which phase
    phases = {k: [r[k] for r in runs] for k in ("step_s", "forward_s", "backward_s", "optimizer_s")}
    spread = {k: [min(v), statistics.median(v), max(v)] for k, v in phases.items()}
    parts = {name: seconds / len(runs) for name, seconds in timer.collect().items()}
    dflash2 = (None if variant == "dflash" else
               {k: getattr(drafter.config, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")})
    if variant == "dflash2-noconv":  # no convolution FLOPs
        dflash2 = dict(dflash2, conv_kernel_size=0)
    samples = int(batch["hidden"].shape[0])
    flops = samples * flops_per_sample(s, s.seq_len, round(mean["blocks"] / samples), dflash2)
    mean.update(variant=variant, shape=a.shape, vocab=s.vocab, dtype=a.dtype, compile=a.compile, samples=samples,
                device=str(device), context_tokens_per_second=samples * s.seq_len / mean["step_s"],
                model_tflop_per_step=flops / 1e12, fraction_of_peak=flops / mean["step_s"] / PEAK_FLOPS,
                parts_s=parts, spread_s=spread, candidates=candidate_spread(proposed),
                peak_gpu_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    return mean


def candidate_spread(proposed: list[torch.Tensor]) -> dict | None:
    """How spread DFlash2's top-K candidates were over the timed steps: their slots, distinct ids, and
    the share of slots holding the most frequent id (a fresh drafter proposes nearly the same
    candidates for every slot, which the selector's scatter-add meets on a few rows; see
    bench/bench_selector_grad.py). None for DFlash."""
    if not proposed:
        return None
    ids = torch.cat(proposed)
    counts = torch.bincount(ids.flatten())
    return {"slots": int(ids.shape[0]), "distinct": int((counts > 0).sum()),
            "top_id_slot_share": float(counts.max()) / ids.shape[0]}


def report(results: dict[str, dict]) -> dict:
    """The variants side by side, and DFlash2's parts from their differences."""
    print(f"{'variant':<15} {'ms/step':>8} {'fwd':>7} {'bwd':>7} {'optim':>6} {'of peak':>8} {'ctx tok/s':>10} "
          f"{'GiB':>6}")
    for name, r in results.items():
        gib = f"{r['peak_gpu_memory_gib']:6.1f}" if r["peak_gpu_memory_gib"] is not None else "     -"
        print(f"{name:<15} {r['step_s'] * 1e3:8.1f} {r['forward_s'] * 1e3:7.1f} {r['backward_s'] * 1e3:7.1f} "
              f"{r['optimizer_s'] * 1e3:6.1f} {r['fraction_of_peak']:8.1%} {r['context_tokens_per_second']:10.0f} {gib}")
    for name, r in results.items():
        print(f"{name:<15} min / median / max ms: " + ", ".join(
            f"{phase.removesuffix('_s')} " + " / ".join(f"{v * 1e3:.1f}" for v in r["spread_s"][phase])
            for phase in ("step_s", "forward_s", "backward_s", "optimizer_s")))
        if c := r.get("candidates"):
            print(f"{name:<15} candidates: {c['distinct']:,} distinct ids over {c['slots']:,} slots' top-K, the most "
                  f"frequent in {c['top_id_slot_share']:.0%} of the slots")
    ms = {name: r["step_s"] * 1e3 for name, r in results.items()}
    parts: dict[str, float] = {}
    if "dflash" in ms and "dflash2" in ms:
        parts["dflash2 over dflash"] = ms["dflash2"] - ms["dflash"]
        print(f"tokens/s dflash2 / dflash: {ms['dflash'] / ms['dflash2']:.3f}x")
    if "dflash2" in ms and "dflash2-noconv" in ms:
        parts["convolutions (dflash2 - dflash2-noconv)"] = ms["dflash2"] - ms["dflash2-noconv"]
    timed = results.get("dflash2-noconv", results.get("dflash2", {})).get("parts_s", {})
    if "exact_topk" in timed:
        parts["top-K (timed in the step)"] = timed["exact_topk"] * 1e3
    if "selector_objective" in timed:
        parts["selector forward (timed in the step)"] = timed["selector_objective"] * 1e3
    if "dflash" in ms and "dflash2-noconv" in ms:
        head = ms["dflash2-noconv"] - ms["dflash"]
        parts["head: top-K + selector (dflash2-noconv - dflash)"] = head
        parts["  of it the selector's backward, its optimizer step and the rest"] = (
            head - timed.get("exact_topk", 0.0) * 1e3 - timed.get("selector_objective", 0.0) * 1e3)
    for name, value in parts.items():
        print(f"{name:<66} {value:8.2f} ms/step")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quality-bpe")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default bench_train's)")
    parser.add_argument("--vocab", type=int, default=None, help="the target's vocabulary (default the shape's)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, run in this order in one process (of {', '.join(VARIANTS)})")
    parser.add_argument("--drafter-type", choices=VARIANTS, default=None, help="one variant alone (--variants X)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after two warm-up steps)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="bf16: autocast, as the trainer on CUDA (the default there); fp32 elsewhere")
    parser.add_argument("--compile", action="store_true", help="torch.compile the drafter's forward, as the trainer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--head-kernels", choices=("compiled", "eager"), default="compiled",
                        help="under --compile, the head's loss as the trainer runs it (compiled: fused chunks and "
                             "the selector's gather-reductions) or the eager path before them")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators per variant")
    parser.add_argument("--json", help="also write the figures to this file")
    a = parser.parse_args()
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    variants = [a.drafter_type] if a.drafter_type else [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants {a.variants!r}: choose among {', '.join(VARIANTS)}.")
    results = {}
    from dflash.train.loss import head_loss

    head_loss.COMPILED_KERNELS = a.head_kernels == "compiled"
    for variant in variants:
        results[variant] = run_variant(a, variant)
        print(f"{variant}: {results[variant]['step_s'] * 1e3:.1f} ms/step", flush=True)
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    parts = report(results)
    card = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    out = {"bench": "profile_step", "card": card, "shape": a.shape, "variants": results, "parts_ms": parts}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

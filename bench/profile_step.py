"""One training step of the drafter (compute_loss + backward), section by section, without the trainer.

Builds a drafter of a bench_train shape from random target tensors and a synthetic batch (a
prompt, then the completion, as bench_train's cache), and times the forward, the loss and the
backward of `--steps` steps; `--profile` also prints torch.profiler's top operators and the time
of the DFlash2 parts (the convolutions, the top-K and the selector). DFlash against DFlash2 on
the same batch is the cost of DFlash2's parts:

    python bench/profile_step.py --shape quality --samples 4 --vocab 8192 --drafter-type dflash2
    python bench/profile_step.py --shape quality --samples 4 --vocab 8192 --drafter-type dflash
    python bench/profile_step.py --shape quality --vocab 8192 --dtype bf16 --compile   # one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from bench_train import BATCH, LAYER_IDS, PROMPT, SHAPES


def build(a: argparse.Namespace):
    from dflash.train.drafter_config import DrafterConfig
    from dflash.train.model import DFlashDrafter
    from dflash.train.target_weights import TargetWeights

    s = SHAPES[a.shape]
    if a.vocab:
        s = dataclasses.replace(s, vocab=a.vocab)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    weights = TargetWeights(embed_tokens=torch.randn(s.vocab, s.hidden, generator=g),
                            lm_head=torch.randn(s.vocab, s.hidden, generator=g) / s.hidden**0.5)
    config = DrafterConfig(
        hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        intermediate_size=s.intermediate, vocab_size=s.vocab, num_target_layers=s.target_layers,
        num_hidden_layers=s.draft_layers, target_layer_ids=LAYER_IDS[s.target_layers], block_size=s.block_size,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960,
        attention_backend=a.attention_backend or ("flex" if device.type == "cuda" else "sdpa"),
        mask_token_id=s.vocab - 1, drafter_type=a.drafter_type)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, weights).to(device).train()
    samples = a.samples or BATCH[a.shape]
    width = len(LAYER_IDS[s.target_layers]) * s.hidden
    mask = torch.ones(samples, s.seq_len, dtype=torch.long)
    mask[:, : int(s.seq_len * PROMPT[a.shape])] = 0
    batch = {"hidden": torch.randn(samples, s.seq_len, width, generator=g).to(torch.bfloat16),
             "input_ids": torch.randint(0, s.vocab - 1, (samples, s.seq_len), generator=g),
             "loss_mask": mask, "lengths": torch.full((samples,), s.seq_len)}
    return s, drafter, {k: v.to(device) for k, v in batch.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quality")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default bench_train's)")
    parser.add_argument("--vocab", type=int, default=None, help="the target's vocabulary (default the shape's)")
    parser.add_argument("--drafter-type", choices=("dflash", "dflash2"), default="dflash2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as on CUDA")
    parser.add_argument("--compile", action="store_true", help="torch.compile the drafter's forward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    parser.add_argument("--json", help="also write the figures to this file")
    a = parser.parse_args()

    from dflash.train import dflash2
    from dflash.train.objective import ObjectiveConfig, compute_loss

    s, drafter, batch = build(a)
    if a.compile:
        drafter.compile_training()
    device = batch["hidden"].device
    objective = ObjectiveConfig(max_anchors=s.anchors)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if a.dtype == "bf16"
                else torch.autocast(device.type, enabled=False))
    params = [p for p in drafter.parameters() if p.requires_grad]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(seed: int) -> dict[str, float]:
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        with autocast:
            out = compute_loss(drafter, batch, objective, generator=torch.Generator().manual_seed(seed))
        sync()
        forward = time.perf_counter()
        out.loss.backward()
        sync()
        end = time.perf_counter()
        for p in params:
            p.grad = None
        return {"forward_s": forward - start, "backward_s": end - forward, "step_s": end - start,
                "step_cpu_s": time.process_time() - cpu, "blocks": int(out.anchor_valid.sum())}

    step(0)  # warm-up (and the compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if a.profile:
        from torch.profiler import ProfilerActivity, profile, record_function

        wrapped = []
        for owner, name in ((dflash2.GroupedDynamicConv, "prepare"), (dflash2.GroupedDynamicConv, "finish"),
                            (dflash2, "top_candidates"), (dflash2.CandidateSelector, "forward"),
                            (dflash2, "selector_objective")):
            original = getattr(owner, name)

            def timed(*args, _f=original, _n=f"dflash2.{name}", **kw):
                with record_function(_n):
                    return _f(*args, **kw)

            wrapped.append((owner, name, original))
            setattr(owner, name, timed)
        import dflash.train.objective as objective_module
        objective_module.selector_objective = dflash2.selector_objective
        wrapped.append((objective_module, "selector_objective", original))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, profile_memory=True) as prof:
            runs = [step(1 + i) for i in range(a.steps)]
        for owner, name, original in wrapped:
            setattr(owner, name, original)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        print(events.table(sort_by=sort, row_limit=30), flush=True)
        total = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        for e in events:  # the DFlash2 parts' forward (their backward is in the operators above)
            if e.key.startswith("dflash2."):
                print(f"{e.key}: {getattr(e, total) / 1e3 / a.steps:.1f} ms/step in {e.count // a.steps} calls")
    else:
        runs = [step(1 + i) for i in range(a.steps)]
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    mean.update(drafter_type=a.drafter_type, shape=a.shape, vocab=s.vocab, dtype=a.dtype, compile=a.compile,
                samples=int(batch["hidden"].shape[0]), device=str(device),
                peak_gpu_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    print(json.dumps(mean, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(mean, f)


if __name__ == "__main__":
    main()

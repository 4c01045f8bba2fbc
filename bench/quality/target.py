"""The benchmark's target: a Qwen3 LM trained from scratch on a domain's corpus (over bytes or
a learned BPE), and its own completions (the drafter's training data)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from dflash.eval.target import forward_with_cache, new_kv_cache
from vocab import ByteVocabulary, Vocabulary


def build_target(hidden_size: int, num_layers: int, seed: int, vocab: Vocabulary | None = None) -> Any:
    """A randomly initialized Qwen3 causal LM over `vocab` (default: bytes; head width 64, or
    less). Ids of the vocabulary no text uses (a byte vocabulary padded to a real target's size)
    get their logits driven down by training, as a real target's rare tokens, and the drafter
    shares their head rows."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    vocab = vocab or ByteVocabulary()
    vocab_size = vocab.size

    head_dim = min(64, hidden_size // 2)
    heads = hidden_size // head_dim
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=(8 * hidden_size) // 3 // 64 * 64 or 128,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
        head_dim=head_dim, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _windows(stream: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _autocast(device: torch.device, enabled: bool = True) -> Any:
    if device.type == "cuda" and enabled:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_target(model: Any, stream: np.ndarray, *, steps: int, batch_size: int, seq_len: int, lr: float,
                 seed: int, device: torch.device, log: Any = print) -> dict[str, float]:
    """Next-token training on random windows of the stream (AdamW, warmup + cosine, bf16 on CUDA)."""
    data = torch.from_numpy(stream.astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=device.type == "cuda")
    warmup = max(1, steps // 25)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        window = _windows(data, batch_size, seq_len, g).to(device, non_blocking=True)
        with _autocast(device):
            loss = model(input_ids=window, labels=window).loss  # the model shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))  # CPU-GPU sync point: only at log steps
            log(f"  target step {step:5d}/{steps}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.0f} s)")
    return {"final_train_loss": losses[-1], "tokens_seen": steps * batch_size * seq_len}


@torch.no_grad()
def mean_loss(model: Any, stream: np.ndarray, *, windows: int, seq_len: int, seed: int, device: torch.device) -> float:
    """Mean next-token cross-entropy (nats per token) on `windows` fixed random windows of the stream."""
    data = torch.from_numpy(stream.astype(np.int64))
    batch = _windows(data, windows, seq_len, torch.Generator().manual_seed(seed))
    model.eval()
    total = 0.0
    for i in range(0, windows, 32):
        chunk = batch[i : i + 32].to(device)
        with _autocast(device):
            total += float(model(input_ids=chunk, labels=chunk).loss) * len(chunk)
    return total / windows


@torch.no_grad()
def complete(model: Any, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int,
             device: torch.device, *, autocast: bool = True) -> list[list[int]]:
    """The target's continuations of equal-length `prompts` (greedy at temperature 0, else sampled),
    exactly `new_tokens` each: one prefill, then one token per pass over the KV cache (bf16
    autocast on CUDA unless `autocast` is off: then in the model's own dtype)."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = new_kv_cache(model)  # the engine's helpers: the cache keyword differs across transformers
    with _autocast(device, autocast):
        out = forward_with_cache(model, cache, input_ids=ids, logits_to_keep=1)
    tokens = []
    for _ in range(new_tokens):
        logits = out.logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
        else:
            nxt = logits.argmax(dim=-1, keepdim=True)
        tokens.append(nxt)
        with _autocast(device, autocast):
            out = forward_with_cache(model, cache, input_ids=nxt)
    return torch.cat(tokens, dim=1).tolist()  # one transfer at the end

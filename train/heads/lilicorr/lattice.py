"""LiLiCorr's candidate-lattice correlator: its module, its scores, its loss and its walk.

Names, shapes and arithmetic are those of vLLM 0.34.0 (`model_executor/models/lilicorr.py`,
`LiLiCorrHead`) and SGLang 0.5.23 (`srt/models/lilicorr.py`, `LiLiCorrHead`; its candidates and
anchor: `srt/speculative/lilicorr_utils.py`); docs/drafter.md, "LiLiCorr", states them.

Per drafted slot s (1..S of a block, S = block_size - 1 or fewer) the K best tokens of the full
vocabulary's log-softmax of the backbone's logits are the slot's candidates. Each candidate is a
token of the lattice (S * K of them): the target embedding of its id (through `token_proj` when
the head is narrower than the drafter), plus the slot's state (`pass_hidden_proj`), plus an MLP of
five features of its log-prob (log p, p, log p - max log p, rank / (K - 1), is-top-1), plus a slot
and a rank embedding. Layers of attention over the whole lattice (a learned per-head bias of the
slots' distance and of sharing a slot) and MLPs correlate them. The anchor, the fused context of
the last verified token (zero where there is none), gives an outgoing unit vector; every
candidate an outgoing and an incoming one (both from `factor_input_proj` of [x, a, x * a]). The
score of anchor -> candidate j of slot 1 is <anchor_out, in[1, j]>, of candidate i of slot s ->
candidate j of slot s+1 <out[s, i], in[s+1, j]>, times `logit_scale`. Decoding walks that chain
from the anchor (greedy: the best successor of the previous choice; sampled: softmax(score / T)
over the K successors) with no log-prob prior added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dflash.train.model.layers import RMSNorm
from torch import nn

NUM_FEATURES = 5
"""[log p, p, log p - max log p, rank / (K - 1), is-top-1] per candidate, in the trained Linear's order."""


class LatticeMLP(nn.Module):
    """`down_proj(silu(up_proj(x)))`, both with a bias (vLLM's NemotronHMLP with bias, SGLang's LiLiCorrMLP)."""

    def __init__(self, in_size: int, mid_size: int, out_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(in_size, mid_size)
        self.down_proj = nn.Linear(mid_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """nn.MultiheadAttention's parameter layout (`in_proj_weight` [3H, H], `in_proj_bias`, `out_proj`)
    with an additive per-head bias, through SDPA."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden_size))
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = F.linear(x, self.in_proj_weight.to(x.dtype), self.in_proj_bias.to(x.dtype))
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.hidden_size))


class LatticeLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, eps)
        self.attn = LatticeAttention(hidden_size, num_heads)
        self.mlp_norm = RMSNorm(hidden_size, eps)
        self.mlp = LatticeMLP(hidden_size, int(hidden_size * mlp_ratio), hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """`lilicorr`: the correlator over a block's candidate lattice (the engines' `LiLiCorrHead`)."""

    def __init__(self, *, model_hidden_size: int, block_size: int, rms_norm_eps: float, candidate_topk: int,
                 hidden_size: int, num_layers: int, num_heads: int, mlp_ratio: float, factor_dim: int,
                 vector_eps: float, logit_scale: float) -> None:
        super().__init__()
        width = hidden_size or model_hidden_size  # 0: as wide as the drafter (no token_proj)
        if num_heads < 1 or width % num_heads:
            raise ValueError(f"lilicorr_num_heads {num_heads} must divide the head's width {width}.")
        self.block_size, self.candidate_topk, self.hidden_size = block_size, candidate_topk, width
        self.num_heads, self.vector_eps, self.logit_scale = num_heads, vector_eps, logit_scale
        slots = block_size - 1
        if width != model_hidden_size:  # the engines build it only for a narrower head
            self.token_proj = nn.Linear(model_hidden_size, width)
        self.pass_hidden_proj = nn.Linear(model_hidden_size, width)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, candidate_topk, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(num_heads))
        self.context_proj = nn.Linear(model_hidden_size, width)
        self.layers = nn.ModuleList(LatticeLayer(width, num_heads, mlp_ratio, rms_norm_eps) for _ in range(num_layers))
        self.output_norm = RMSNorm(width, rms_norm_eps)
        self.anchor_norm = RMSNorm(width, rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, factor_dim)
        self.in_head = nn.Linear(width, factor_dim)
        self.anchor_out_head = nn.Linear(width, factor_dim)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight normal(std), biases and the attention biases 0, norms 1; the slot and rank
        embeddings normal(std), so that candidates of one slot and rank differ from the start."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=std)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, LatticeAttention):
                    nn.init.normal_(module.in_proj_weight, std=std)
                    nn.init.zeros_(module.in_proj_bias)
                elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                    nn.init.ones_(module.weight)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
            nn.init.normal_(self.slot_embedding, std=std)
            nn.init.normal_(self.rank_embedding, std=std)
            self.relative_slot_bias.zero_()
            self.same_slot_bias.zero_()

    def attention_bias(self, slots: int, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """[1 or M, heads, S*K, S*K]: relative_slot_bias[h, slot(q) - slot(k) + B - 1] plus
        same_slot_bias[h] where both lie in one slot; -inf at the keys of slots `key_valid` [M, S]
        marks False (training's unscored slots)."""
        k = self.candidate_topk
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(k)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        bias = (bias + (rel == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]).unsqueeze(0)
        if key_valid is None:
            return bias
        blocked = ~key_valid.repeat_interleave(k, dim=1)  # [M, S*K]
        return bias.masked_fill(blocked[:, None, None, :], float("-inf"))

    def forward(self, token_embeddings: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
               anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor,
               key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """The lattice's scaled scores [M, S, K, K] as vLLM's `LiLiCorrHead.forward` returns them:
        row [s, i] scores the K candidates of slot s after candidate i of slot s - 1; slot 0's rows
        all hold the anchor's scores (the walk reads row 0). `token_embeddings` [M, S, K, D] (the
        target embedding of the candidates), `log_probs` [M, S, K] (their full-vocabulary
        log-probs, best first), `pass_hidden` [M, S, D] (the slots' normed drafter states),
        `anchor_hidden` [M, D] (the fused context of the last verified token), `anchor_valid` [M]."""
        m, slots, k = log_probs.shape
        if not 1 <= slots <= self.block_size - 1 or k != self.candidate_topk:
            raise ValueError(f"a LiLiCorr lattice has 1..{self.block_size - 1} slots of {self.candidate_topk} "
                             f"candidates, got {slots} of {k}.")
        dtype = pass_hidden.dtype
        tokens = token_embeddings.to(dtype)
        tokens = self.token_proj(tokens) if hasattr(self, "token_proj") else tokens
        lp = log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=torch.float32) / max(k - 1, 1)
        top1 = (torch.arange(k, device=lp.device) == 0).float()
        features = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                                rank.expand_as(lp), top1.expand_as(lp)], dim=-1)
        x = tokens + self.pass_hidden_proj(pass_hidden).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(features.to(x.dtype)))
        x = x + self.slot_embedding[:, 0, :slots] + self.rank_embedding[:, 0]
        x = x.reshape(m, slots * k, -1)
        anchor = self.context_proj(anchor_hidden.to(dtype)) * anchor_valid[:, None].to(dtype)
        bias = self.attention_bias(slots, key_valid)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(m, slots, k, -1)
        anchor = self.anchor_norm(anchor)
        row = anchor[:, None, None, :].expand_as(x)
        factor = F.silu(self.factor_input_proj(torch.cat([x, row, x * row], dim=-1)))
        out_vec = F.normalize(self.out_head(factor).float(), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(factor).float(), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(anchor).float(), dim=-1, eps=self.vector_eps)
        start = (anchor_out[:, None, :] * in_vec[:, 0]).sum(-1)  # [M, K]
        pairs = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [M, S-1, K, K]
        first = start[:, None, None, :].expand(-1, 1, k, -1)
        return self.logit_scale * torch.cat([first, pairs], dim=1)


def candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) [..., K] of the K best tokens of the full vocabulary's log-softmax of
    `logits` [..., V], best first (what both engines feed the head)."""
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids, values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)


def walk_rows(scores: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[M, S, K]: each slot's row of `scores` [M, S, K, K] after the candidate index `previous` [M, S]."""
    m, slots, k, _ = scores.shape
    return scores.gather(2, previous[:, :, None, None].expand(m, slots, 1, k)).squeeze(2)


def path_loss(scores: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the walk's weighted cross-entropy along the true path, the walk's choice [M, S]).

    `scores` [M, S, K, K], `ids` [M, S, K] the candidates, `labels` [M, S], `scored` [M, S] bool,
    `weights` [M, S] (0 where not scored). At slot s the walk's row after the true token of slot
    s - 1 (the anchor's row at slot 1) is a softmax over the K candidates; the loss is its negative
    log-probability of the true token, over the slots whose true token and every earlier one are
    candidates (where a walk can still be right: the probability that the walk drafts the true
    prefix is the product of these terms, and nothing the head scores can make a later slot right
    once a true token is missing from its slot). The choice is each slot's argmax in that row (for
    the metrics: what the walk drafts where the earlier slots were right)."""
    found = (ids == labels[..., None]) & scored[..., None]
    present = found.any(-1)
    index = found.long().argmax(-1)  # the true token's candidate (0 where it is none)
    previous = torch.cat([torch.zeros_like(index[:, :1]), index[:, :-1]], dim=1)
    rows = walk_rows(scores, previous)
    alive = present.long().cumprod(dim=1).bool()
    nll = F.cross_entropy(rows.flatten(0, 1), index.flatten(), reduction="none").view_as(index)
    w = weights * alive
    loss = (w * nll).sum() / w.sum().clamp(min=1e-12)
    choice = ids.gather(-1, rows.argmax(-1, keepdim=True)).squeeze(-1)
    return loss, choice

"""XPress: a causal refiner over the block that adds a logit bias to the backbone's logits, the
block resolved by Jacobi passes (`Qwen3XPressModel`).

The refiner (vLLM 0.34's `XPressRefinerHead` in qwen3_xpress.py, speculators 0.9's in
models/xpress/; the names, shapes and arithmetic are theirs, docs/drafter.md "XPress"), over one
block of T slots (slot 0 the anchor) with the backbone's normed states h [T, D]:

    hcache = [down_h(h) ; down_g(mean over the block of h)]            [T, 2r], once per block
    x      = in_proj([hcache ; w1(prev)])                               [T, r]
    x      = x + (L * tril) x   (per channel c: x[k] += sum_{j<=k} L[c, k, j] x[j])
    x      = x + mlp(x)         (SwiGLU of width xpress_mlp_hidden)
    logits = backbone logits + w2(x)                                    [T, V]

where prev[k] is the token before slot k: the one before the anchor for slot 0, the token drafted
(or, in training, the true one) at slot k-1 for the others. The mix is causal, so slot k depends
on prev[0..k] alone: a Jacobi pass (every slot re-scored from the previous pass's tokens, started
from the backbone's argmax) settles one more slot each time, and T-1 passes give the sequential
decode. vLLM runs `xpress_passes` of them over the backbone's top-C tokens per slot (`xpress_topc`).

Training (speculators' `XPressDraftModel`): the refined logits with the true previous tokens (the
teacher-forced pass), plus `xpress_consistency_weight` x the mean over `xpress_consistency_passes`
free-running rounds (round j fed round j-1's argmax, round 0 the backbone's; no gradient through
the argmax), each a cross-entropy on the slots' labels, weighed against the backbone's own loss
as speculators' base anchor (`xpress_base_anchor_weight`: backbone x 0.6 + refined x 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash.runtime.findings import Finding
from dflash.train.heads.base import (
    DFlashDrafter,
    DrafterConfig,
    DraftHead,
    HeadExportError,
    HeadInputs,
    HeadMemory,
    HeadOutput,
    ObjectiveConfig,
)
from dflash.train.heads.limits import below, first, not_finite, out_of_range

if TYPE_CHECKING:
    import torch
    from torch import nn

# vLLM 0.34 (qwen3_xpress.py, Qwen3XPressModel) reads these at the top level of config.json;
# num_jacobi_passes is speculators 0.9's key (XPressSpeculatorConfig) for the decode's passes.
TOP_LEVEL_KEYS = ("xpress_block_size", "xpress_rank", "xpress_mlp_hidden", "xpress_topc", "num_jacobi_passes")

# vLLM's load_weights maps a checkpoint's `xpress_head.<key>` through XPressRefinerHead.HYBRID_KEY_MAP
# (our tensor names, the keys) and takes any other key as the attribute's own name (the values):
# a checkpoint may use either. `mix_L` there is the serving form L * tril + I, which vLLM skips.
VLLM_ATTRIBUTE_NAMES = {"mlp.gate_proj.weight": "mlp_gate.weight", "mlp.up_proj.weight": "mlp_up.weight",
                        "mlp.down_proj.weight": "mlp_down.weight"}


def _refiner_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class XPressMix(nn.Module):
        """The per-channel causal mix of the block's slots: `L` [r, T, T] raw (vLLM folds it into
        L * tril + I after loading), started at 0 (no mixing)."""

        def __init__(self, rank: int, block_size: int) -> None:
            super().__init__()
            self.L = nn.Parameter(torch.zeros(rank, block_size, block_size))
            self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mixed = self.L * self.tril.to(self.L.dtype)
            return x + torch.einsum("ckj,njc->nkc", mixed.to(x.dtype), x)

    class XPressMLP(nn.Module):
        def __init__(self, rank: int, hidden: int) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(rank, hidden, bias=False)
            self.up_proj = nn.Linear(rank, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, rank, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class XPressRefiner(nn.Module):
        """The refiner's tensors under `xpress_head.`, named as vLLM's loader takes them."""

        def __init__(self, hidden_size: int, vocab_size: int, block_size: int, rank: int, mlp_hidden: int) -> None:
            super().__init__()
            self.rank = rank
            self.w1 = nn.Embedding(vocab_size, rank)
            self.down_h = nn.Linear(hidden_size, rank, bias=False)
            self.down_g = nn.Linear(hidden_size, rank, bias=False)
            self.in_proj = nn.Linear(3 * rank, rank, bias=False)
            self.mix = XPressMix(rank, block_size)
            self.mlp = XPressMLP(rank, mlp_hidden)
            self.w2 = nn.Linear(rank, vocab_size, bias=False)

        def reset_parameters(self, std: float) -> None:
            """speculators' start: every Linear and the embedding normal(std), the mix 0."""
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, (nn.Linear, nn.Embedding)):
                        module.weight.normal_(0.0, std)
                self.mix.L.zero_()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            """`hidden_cache`: the first call on a block goes through the module, so that a sharded
            (FSDP) refiner gathers its parameters, which stay gathered for the passes after it."""
            return self.hidden_cache(h)

        def hidden_cache(self, h: torch.Tensor) -> torch.Tensor:
            """[n, T, D] the block's states -> [n, T, 2r], the part no pass changes."""
            h = h.to(self.down_h.weight.dtype)
            g = h.mean(dim=1, keepdim=True).expand_as(h)
            return torch.cat([self.down_h(h), self.down_g(g)], dim=-1)

        def latent(self, prev_ids: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
            """prev_ids [n, T] (the token before each slot) -> the refined latent [n, T, r]."""
            x = self.in_proj(torch.cat([hcache, self.w1(prev_ids).to(hcache.dtype)], dim=-1))
            x = self.mix(x)
            return x + self.mlp(x)

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
            # a checkpoint in vLLM's layout may name the MLP by vLLM's attributes, and carry the
            # serving form mix_L = L * tril + I instead of (or beside) the raw mix.L
            for ours, theirs in VLLM_ATTRIBUTE_NAMES.items():
                if prefix + theirs in state_dict and prefix + ours not in state_dict:
                    state_dict[prefix + ours] = state_dict.pop(prefix + theirs)
            folded = state_dict.pop(prefix + "mix_L", None)
            if folded is not None and prefix + "mix.L" not in state_dict:
                eye = torch.eye(folded.shape[-1], dtype=folded.dtype)
                state_dict[prefix + "mix.L"] = (folded - eye) * self.mix.tril.to(folded.dtype).cpu()
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    return XPressRefiner


def build_refiner(hidden_size: int, vocab_size: int, block_size: int, rank: int, mlp_hidden: int) -> nn.Module:
    """A fresh refiner (`module_name` xpress_head on the drafter)."""
    return _refiner_class()(hidden_size, vocab_size, block_size, rank, mlp_hidden)


def previous_tokens(before: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[n, T] the token before each slot: `before` [n] for slot 0, block[:, k-1] for slot k."""
    import torch

    return torch.cat([before[:, None], block[:, :-1]], dim=1)


@dataclass(kw_only=True)
class XPressSettings:
    """XPress's drafter settings; defaults as vLLM 0.34's XPressRefinerHead and speculators 0.9."""

    xpress_rank: int = 256
    """xpress: low rank r of the refiner (its token embedding, hidden projections, mix and MLP)."""
    xpress_mlp_hidden: int = 512
    """xpress: width of the refiner's SwiGLU MLP (speculators: r x xpress_mlp_ratio 2)."""
    xpress_passes: int = 6
    """xpress: Jacobi passes over the block when decoding (speculators' num_jacobi_passes; block - 1
    passes give the sequential decode exactly)."""
    xpress_topc: int = 512
    """xpress: each pass scores the backbone's top-C tokens per slot, as vLLM serves it (its
    xpress_topc); 0: the whole vocabulary."""

    def refusal(self) -> Finding | None:  # (the defaults are vLLM's)
        return first(below(self, ("xpress_rank", "xpress_mlp_hidden", "xpress_passes"), 1, name_default=True),
                     below(self, ("xpress_topc",), 0, name_default=True))


@dataclass(kw_only=True)
class XPressObjective:
    """The settings of XPress's loss; defaults as speculators 0.9's XPress recipe."""

    xpress_consistency_weight: float = 0.3
    """xpress: weight of the free-running Jacobi rounds' loss (each round fed the previous one's
    argmax, the inputs the refiner meets when decoding; 0: off)."""
    xpress_consistency_passes: int = 3
    """xpress: free-running rounds of the consistency loss (their losses averaged)."""
    xpress_base_anchor_weight: float = 0.6
    """xpress: the backbone's own loss against the refined logits' 1 (speculators' base_anchor_weight:
    it keeps the backbone's argmax, the passes' start, good on its own)."""

    def refusal(self) -> Finding | None:
        return first(
            not_finite(self, ("xpress_consistency_weight", "xpress_base_anchor_weight")),
            below(self, ("xpress_consistency_passes",), 0),
            out_of_range("xpress_consistency_weight", self.xpress_consistency_weight, "0 or more")
            if self.xpress_consistency_weight < 0 else None,
            out_of_range("xpress_base_anchor_weight", self.xpress_base_anchor_weight, "more than 0")
            if self.xpress_base_anchor_weight <= 0 else None)


class XPressHead(DraftHead):
    name = "xpress"
    title = "XPress"
    architecture = "Qwen3XPressModel"
    settings = XPressSettings
    objective_settings = XPressObjective
    module_name = "xpress_head"
    picks_drafts = True
    reads_whole_block = True
    config_key_names = (*TOP_LEVEL_KEYS, "vocab_size", "draft_vocab_size")  # the last two read, not written
    warm_starts_from = ("dflash",)
    # vLLM 0.34 detects the speculator from the architecture (Qwen3XPressForCausalLM); SGLang 0.5.23
    # has no XPress model (none of its srt/models declares one)
    serving = {"name": "XPress", "vllm_method": None, "sglang_algorithm": None, "tags": ["dflash", "xpress"]}

    def build(self, config: DrafterConfig) -> nn.Module:
        c = config
        return build_refiner(c.hidden_size, c.vocab_size, c.block_size, c.xpress_rank, c.xpress_mlp_hidden)

    def initialize(self, drafter: DFlashDrafter, std: float) -> None:
        drafter.xpress_head.reset_parameters(std)

    # -- training ---------------------------------------------------------------------------

    def objective(self, inputs: HeadInputs, objective: ObjectiveConfig) -> HeadOutput:
        import torch
        from dflash.train.loss.head_loss import CHUNK_MIB, chunk_rows, needs_chunks

        d, refiner = inputs.drafter, inputs.drafter.xpress_head
        full, anchors = inputs.block_states, inputs.anchors  # [B, A, T, D], [B, A]
        if full is None or anchors is None or inputs.slots is None:
            raise ValueError("the XPress head reads whole blocks: the objective must pass block_states and anchors.")
        batch, width, block, _ = full.shape
        b, a, k = inputs.slots  # scored slot k + 1 of block (b, a)
        ids = inputs.input_ids
        offsets = torch.arange(block, device=ids.device)
        positions = (anchors[:, :, None] + offsets).clamp(max=ids.shape[1] - 1)  # [B, A, T]
        tokens = ids.gather(1, positions.flatten(1)).view(batch * width, block)  # the true block
        before = ids.gather(1, (anchors - 1).clamp(min=0)).flatten()  # the anchor itself at position 0
        before = torch.where(anchors.flatten() > 0, before, tokens[:, 0])
        hcache = refiner(full.reshape(batch * width, block, -1))  # first: gathers a sharded refiner
        scored_block = b * width + a  # the block of each scored slot, in [B * A]
        slot = k + 1

        latents = [refiner.latent(previous_tokens(before, tokens), hcache)]  # the teacher-forced pass
        passes = objective.xpress_consistency_passes if objective.xpress_consistency_weight > 0 else 0
        if passes:
            drafted = full[:, :, 1:].reshape(batch * width, block - 1, -1)
            for j in range(passes):  # round j: round j-1's argmax before each slot (round 0: the backbone's)
                drafts = self._refined_argmax(d, drafted, latents[-1][:, 1:].detach() if j else None,
                                              d.config.xpress_topc)
                latents.append(refiner.latent(previous_tokens(before, torch.cat([tokens[:, :1], drafts], 1)), hcache))
        scored_latents = torch.stack([lat[scored_block, slot] for lat in latents])  # [1 + passes, N, r]
        vocab, rows = d.lm_head_weight.shape[0], scored_latents.shape[0] * scored_latents.shape[1]
        chunk = (max(1, chunk_rows(vocab, CHUNK_MIB) // len(latents))
                 if needs_chunks(rows, vocab, objective.logits_chunk_mib) else None)
        losses, choice = refined_losses(d, inputs.states, scored_latents, inputs.labels, chunk)
        weights = inputs.weights.detach()
        total = weights.sum().clamp(min=1e-12)
        teacher = (weights * losses[0]).sum() / total
        loss = teacher
        if passes:
            loss = loss + objective.xpress_consistency_weight * (weights * losses[1:]).sum(-1).mean() / total
        # speculators: refined + base_anchor_weight * backbone; ours adds to the backbone's loss at 1
        return HeadOutput(loss=loss / objective.xpress_base_anchor_weight, logged=teacher.detach(), choice=choice)

    @staticmethod
    def _refined_argmax(drafter: DFlashDrafter, states: torch.Tensor, latent: torch.Tensor | None = None,
                        topc: int = 0) -> torch.Tensor:
        """[n, T-1] the argmax of every drafted slot: the backbone's (no `latent`), or the refined one
        (over the backbone's top-C with topc > 0, as vLLM scores a pass), a chunk of rows at a time."""
        import torch

        flat = states.reshape(-1, states.shape[-1])
        lat = None if latent is None else latent.reshape(-1, latent.shape[-1])
        from dflash.train.loss.head_loss import CHUNK_MIB, chunk_rows

        rows = chunk_rows(drafter.lm_head_weight.shape[0], CHUNK_MIB)
        picks = []
        with torch.no_grad():
            for i in range(0, flat.shape[0], rows):
                if lat is None:
                    picks.append(drafter.logits(flat[i:i + rows]).argmax(-1))
                else:
                    picks.append(refined_scores(drafter, flat[i:i + rows], lat[i:i + rows], topc, argmax=True))
        return torch.cat(picks).view(states.shape[:-1])

    def memory(self, config: DrafterConfig) -> HeadMemory:
        c, d, r, m = config, config.hidden_size, config.xpress_rank, config.xpress_mlp_hidden
        params = 2 * c.vocab_size * r + 2 * d * r + 3 * r * r + r * c.block_size ** 2 + 3 * r * m
        # rough, not measured: the teacher-forced pass and the default 3 consistency rounds (J = 4) each
        # score every slot over the vocabulary (float32 logits and their log-softmax, 12 bytes a logit,
        # as the backbone's, chunked past --logits-chunk-mib); per slot each pass's latent, mix and
        # SwiGLU activations in bf16 and the block's hidden cache
        passes = 4
        return HeadMemory(params=params, own_logit_rows=passes, own_logit_bytes=12,
                          slot_bytes=passes * 2 * (4 * r + 3 * m) + 2 * 3 * r)

    # -- decoding ---------------------------------------------------------------------------

    def proposer(self, drafter: DFlashDrafter, temperature: float, seed: int) -> JacobiWalk:
        return JacobiWalk(drafter, temperature, seed)

    # -- the export -------------------------------------------------------------------------

    def export_keys(self, config: DrafterConfig) -> dict[str, Any]:
        c = config
        return {"xpress_block_size": c.block_size, "xpress_rank": c.xpress_rank,
                "xpress_mlp_hidden": c.xpress_mlp_hidden, "xpress_topc": c.xpress_topc,
                "num_jacobi_passes": c.xpress_passes}

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        d = dflash_config  # with the top-level keys of TOP_LEVEL_KEYS (config_key_names)
        vocab = d.get("draft_vocab_size")
        if vocab is not None and d.get("vocab_size") is not None and int(vocab) != int(d["vocab_size"]):
            raise HeadExportError(Finding("train.xpress-draft-vocab", value=int(vocab), vocab_size=int(d["vocab_size"])))
        out = dict(xpress_rank=int(d.get("xpress_rank", 256)), xpress_mlp_hidden=int(d.get("xpress_mlp_hidden", 512)),
                   xpress_topc=int(d.get("xpress_topc", 512)), xpress_passes=int(d.get("num_jacobi_passes", 6)))
        if d.get("xpress_block_size") is not None:
            out["block_size"] = int(d["xpress_block_size"])
        return out

    def describe(self, config: DrafterConfig, shape: str) -> str:
        c = config
        return (f"XPress ({shape}; refiner rank {c.xpress_rank}, MLP {c.xpress_mlp_hidden}; decoded by "
                f"{c.xpress_passes} Jacobi passes over {f'the top-{c.xpress_topc}' if c.xpress_topc else 'the vocabulary'}), "
                "exported as Qwen3XPressModel")

    def warm_start_note(self) -> str:
        return "the refiner at speculators' start (the mix at 0)"


def refined_scores(drafter: DFlashDrafter, states: torch.Tensor, latent: torch.Tensor, topc: int, *,
                   argmax: bool = False) -> Any:
    """The refined logits of rows of slots, states [n, D] and latents [n, r]: with topc > 0 over
    the backbone's top-C per row, (ids [n, C], scores [n, C]), else over the vocabulary (None,
    [n, V]); with `argmax` only the refined argmax [n] (token ids)."""
    import torch

    base = drafter.logits(states)
    w2 = drafter.xpress_head.w2.weight
    if topc and topc < base.shape[-1]:
        base_c, ids = torch.topk(base, topc, dim=-1)
        scores = base_c.float() + torch.bmm(w2[ids].to(latent.dtype), latent[:, :, None]).squeeze(-1).float()
        return ids.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1) if argmax else (ids, scores)
    scores = base.float() + drafter.xpress_head.w2(latent).float()
    return scores.argmax(-1) if argmax else (None, scores)


def refined_losses(drafter: DFlashDrafter, states: torch.Tensor, latents: torch.Tensor, labels: torch.Tensor,
                   rows_per_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [J, N] of the labels under each pass's refined logits, the first pass's
    argmax [N]): states [N, D] of the scored slots, latents [J, N, r] of J passes. With
    `rows_per_chunk`, chunks of rows are recomputed in the backward (one chunk's [J, n, V] logits
    live at a time); None: all rows at once."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    w2 = drafter.xpress_head.w2

    def chunk(h: torch.Tensor, lat: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = drafter.logits(h).float()[None] + w2(lat).float()  # [J, n, V]
        ce = F.cross_entropy(logits.flatten(0, 1), t.repeat(lat.shape[0]), reduction="none")
        return ce.view(lat.shape[0], -1), logits[0].argmax(-1)

    if rows_per_chunk is None:
        return chunk(states, latents, labels)
    losses, picks = [], []
    for i in range(0, states.shape[0], rows_per_chunk):
        part = (states[i:i + rows_per_chunk], latents[:, i:i + rows_per_chunk], labels[i:i + rows_per_chunk])
        if torch.is_grad_enabled():
            ce, pick = checkpoint(chunk, *part, use_reentrant=False)
        else:
            ce, pick = chunk(*part)
        losses.append(ce)
        picks.append(pick)
    if not losses:
        return latents.new_zeros(latents.shape[0], 0, dtype=torch.float32), labels.new_zeros(0)
    return torch.cat(losses, dim=1), torch.cat(picks)


class JacobiWalk:
    """XPress's drafts of a block, as vLLM decodes them: the backbone's argmax, then
    `xpress_passes` Jacobi passes, each re-scoring every slot from the previous pass's tokens
    (over the backbone's top-C per slot with xpress_topc > 0). At T > 0 each slot's scores get
    Gumbel noise drawn once per block, so the passes converge to a sample of the sequential
    refined distribution; `q` keeps the last pass's softmax(scores / T) (over `q_ids`, the
    candidates, or the vocabulary where None) for a verifier that rejection-samples. Eval's loop
    checks each draft against the target's own choice, which is lossless for any draft."""

    def __init__(self, drafter: DFlashDrafter, temperature: float, seed: int) -> None:
        import torch

        self.drafter, self.temperature = drafter, temperature
        self.generator: torch.Generator | None = None
        self.q: torch.Tensor | None = None
        self.q_ids: torch.Tensor | None = None
        if temperature > 0:
            self.generator = torch.Generator(device=drafter.embed_weight.device).manual_seed(seed + 1)

    def __call__(self, states: torch.Tensor, anchors: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """states [B, T, D] of the whole block (the anchor's first), anchors [B], `before` [B] the
        token before each anchor -> drafts [B, T-1]."""
        import torch

        d, c = self.drafter, self.drafter.config
        refiner = d.xpress_head
        batch, block, width = states.shape
        slots = states[:, 1:].reshape(-1, width)
        base = d.logits(slots)
        topc = c.xpress_topc if 0 < c.xpress_topc < base.shape[-1] else 0
        if topc:
            base, ids = torch.topk(base, topc, dim=-1)
            w2 = refiner.w2.weight[ids]  # [n, C, r], gathered once per block as vLLM does
        base = base.float()
        noise = None
        if self.temperature > 0:
            uniform = torch.rand(base.shape, generator=self.generator, device=base.device).clamp_(1e-20, 1.0)
            noise = -torch.log(-torch.log(uniform))
        hcache = refiner(states)

        def pick(scores: torch.Tensor) -> torch.Tensor:
            choice = (scores / self.temperature + noise if noise is not None else scores).argmax(-1)
            return (ids.gather(1, choice[:, None]).squeeze(1) if topc else choice).view(batch, block - 1)

        drafts, scores = pick(base), base
        for _ in range(c.xpress_passes):
            block_ids = torch.cat([anchors[:, None], drafts], dim=1)
            latent = refiner.latent(previous_tokens(before, block_ids), hcache)[:, 1:].reshape(-1, refiner.rank)
            if topc:
                bias = torch.bmm(w2.to(latent.dtype), latent[:, :, None]).squeeze(-1)
            else:
                bias = refiner.w2(latent)
            scores = base + bias.float()
            drafts = pick(scores)
        if self.temperature > 0:
            self.q = torch.softmax(scores / self.temperature, dim=-1).view(batch, block - 1, -1)
            self.q_ids = ids.view(batch, block - 1, -1) if topc else None
        return drafts


HEAD = XPressHead()

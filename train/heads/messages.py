"""What the drafter heads (dflash.train.heads) tell their user: one renderer per finding code
(`dflash.runtime.findings`). A head's settings out of range are train/messages.py's
`train.setting-range`; what is here is a head's own: a setting that does not fit the target, an
export's layout the head cannot decode."""

from __future__ import annotations

from dflash.runtime.findings import renders


@renders("train.unknown-head", example=dict(name="dflash3", heads=["dflash", "dflash2", "dspark"]))
def _unknown_head(name, heads):
    return f"drafter_type must be one of {', '.join(heads)}, got {name!r}."


@renders("train.conv-group-size", example=dict(value=16, hidden_size=40, fits=10))
def _conv_group_size(value, hidden_size, fits):
    return (f"conv_group_size {value} must divide the hidden size {hidden_size}: pass --conv-group-size {fits} "
            f"(the largest divisor of {hidden_size} up to it), or --drafter-type dflash for a plain DFlash drafter, "
            "which has no convolutions.")


@renders("train.selector-top-k", example=dict(value=16, vocab_size=8))
def _selector_top_k(value, vocab_size):
    return (f"selector_top_k ({value}) must be in 1..{vocab_size}, the target's vocabulary: pass --selector-top-k "
            f"{vocab_size}, or --drafter-type dflash for a plain DFlash drafter, which has no selector.")


@renders("train.input-embedding-scale", example=dict(value=2.0))
def _input_embedding_scale(value):
    return (f"input_embedding_scale {value} is not supported: this trainer's drafters embed with the target's "
            "embedding as it is (1.0).")


@renders("train.markov-rank", example=dict(value=0))
def _markov_rank(value):
    return (f"markov_rank ({value}) must be at least 1: the Markov head is what DSpark adds (vLLM and SGLang refuse "
            "a DSpark drafter without one); pass --markov-rank 256, or --drafter-type dflash for a drafter without it.")


@renders("train.draft-vocab-size", example=dict(value=64, vocab_size=128))
def _draft_vocab_size(value, vocab_size):
    return (f"draft_vocab_size {value}: a DSpark draft vocabulary smaller than the target's ({vocab_size}) is not "
            "supported by this trainer (it needs a pruned lm_head and a token map); leave --draft-vocab-size out "
            "to draft over the target's vocabulary.")


@renders("train.markov-head-type", example=dict(value="gated"))
def _markov_head_type(value):
    return (f"markov_head_type {value!r}: only the vanilla Markov head (markov_w1, markov_w2) is supported; this "
            "drafter's gated or recurrent head is not.")


@renders("train.sample-from-anchor", example=dict(value=None))
def _sample_from_anchor(value):
    return (f"sample_from_anchor is {'absent' if value is None else value} (true: speculators' default): the anchor "
            "slot drafts too, block_size drafts a block; this trainer's DSpark drafters draft block_size - 1 from a "
            "verified anchor (sample_from_anchor false) and decode no other layout.")


@renders("train.export-lacks-keys", example=dict(architecture="LiLiCorrDraftModel", keys=["lilicorr_factor_dim"]))
def _export_lacks_keys(architecture, keys):
    return (f"This {architecture} export's config.json lacks {', '.join(keys)}: the engines refuse it (no "
            "defaults); export it again with dflash-train export.")


@renders("train.xpress-draft-vocab", example=dict(value=64, vocab_size=128))
def _xpress_draft_vocab(value, vocab_size):
    return (f"draft_vocab_size {value} is not the target's vocabulary ({vocab_size}): XPress drafts over the whole "
            "vocabulary (vLLM refuses a smaller one too).")


@renders("train.lilicorr-topk", example=dict(value=6, most=16))
def _lilicorr_topk(value, most):
    return (f"lilicorr_candidate_topk ({value}) must be a power of two up to {most} (vLLM and SGLang refuse "
            "others): pass --lilicorr-candidate-topk 8.")


@renders("train.lilicorr-num-heads", example=dict(value=5, width=64))
def _lilicorr_num_heads(value, width):
    return (f"lilicorr_num_heads ({value}) must divide the correlator's width {width} (--lilicorr-hidden-size, 0: "
            "the drafter's): pass --lilicorr-num-heads with a divisor.")


@renders("train.lilicorr-disabled", example={})
def _lilicorr_disabled():
    return ("This LiLiCorrDraftModel export has lilicorr_enabled false: vLLM refuses it and SGLang builds no "
            "correlator; export it again with lilicorr_enabled true.")


@renders("train.lilicorr-convolutions", example={})
def _lilicorr_convolutions():
    return ("A LiLiCorr export with convolutions (conv_kernel_size) is not supported by this trainer: its backbone "
            "is the plain DFlash one.")

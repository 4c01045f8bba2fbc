"""What dflash.train.model tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import renders

# -- the target: what the drafter borrows from it ------------------------------------------------


@renders("train.target-no-config", example=dict(dir="/models/Qwen3-8B/weights"))
def _target_no_config(dir):
    return (f"No config.json in the target directory {dir}; pass the folder of a Hugging Face checkpoint (the one "
            "holding config.json and *.safetensors).")


@renders("train.target-no-safetensors", example=dict(dir="/models/t", pickled=True))
def _target_no_safetensors(dir, pickled):
    return (f"No safetensors weights in the target directory {dir}."
            + (" It has PyTorch .bin/.pt weights: re-save them with save_pretrained(..., safe_serialization=True)."
               if pickled else ""))


@renders("train.target-no-embedding", example=dict(dir="/models/t"))
def _target_no_embedding(dir):
    return (f"The target checkpoint in {dir} has no '*embed_tokens.weight' tensor; the drafter needs the target's "
            "input embedding.")


@renders("train.target-no-lm-head", example=dict(dir="/models/t"))
def _target_no_lm_head(dir):
    return (f"The target checkpoint in {dir} has no 'lm_head.weight' and its config does not set "
            "tie_word_embeddings; check that every shard listed in the index is present.")


@renders("train.target-no-final-norm", example=dict(dir="/models/t", tensor="model.norm.weight"))
def _target_no_final_norm(dir, tensor):
    return (f"The target checkpoint in {dir} has no {tensor} tensor for its final norm, which soft labels from "
            "last_hidden need: check that every shard is present, or use top-k soft labels (--store-topk).")


@renders("train.target-shard-missing", example=dict(shard="model-00002-of-00004.safetensors",
                                                    index="/models/t/model.safetensors.index.json"))
def _target_shard_missing(shard, index):
    return f"Shard {shard} listed in {index} is missing."


@renders("train.target-modules", example=dict(file="/models/t/config.json", error="unknown model type 'x'"))
def _target_modules(file, error):
    return (f"Cannot build the target's modules from {file} ({error}); soft labels from last_hidden need a "
            "transformers that knows this model type, or use --store-topk.")


@renders("train.target-no-norm-module", example=dict(dir="/models/t", model="XForCausalLM"))
def _target_no_norm_module(dir, model):
    return (f"The target in {dir} ({model}) has no final norm module (model.norm); soft labels from last_hidden "
            "cannot be recomputed: use --store-topk.")


@renders("train.target-tokenizer", example=dict(dir="/models/t", error="tokenizer.json: invalid JSON"))
def _target_tokenizer(dir, error):
    return (f"Cannot read the tokenizer in {dir} to choose the mask token ({error}); fix the tokenizer files or "
            "pass --mask-token-id.")


@renders("train.target-embedding-shape", example=dict(embedding=[256, 64], lm_head=[256, 64], vocab_size=512,
                                                      hidden_size=64))
def _target_embedding_shape(embedding, lm_head, vocab_size, hidden_size):
    return (f"The target's embedding {tuple(embedding)} / lm_head {tuple(lm_head)} do not match vocab_size "
            f"{vocab_size} x hidden_size {hidden_size}; the drafter's dimensions must come from the same target.")


@renders("train.hidden-width", example=dict(width=192, expected=128, layers=2, hidden_size=64))
def _hidden_width(width, expected, layers, hidden_size):
    return (f"The hidden states have width {width}, expected {expected} ({layers} target layers x {hidden_size}); "
            "the cache was extracted with other target layers or another model.")


@renders("train.rope-type", example=dict(rope_type="longrope2"))
def _rope_type(rope_type):
    return f"Unsupported rope_type {rope_type!r} in the target's RoPE settings."


# -- the drafter's settings -------------------------------------------------------------------------


@renders("train.drafter-size", example=dict(field="num_hidden_layers", value=0))
def _drafter_size(field, value):
    return f"The drafter's {field} must be >= 1, got {value}."


@renders("train.drafter-kv-heads", example=dict(heads=8, kv_heads=3))
def _drafter_kv_heads(heads, kv_heads):
    return (f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}); fix one of "
            "them.")


@renders("train.drafter-block-size", example=dict(block_size=1))
def _drafter_block_size(block_size):
    return f"--block-size must be >= 2 (the anchor and a prediction), got {block_size}."


@renders("train.drafter-no-target-layers", example={})
def _drafter_no_target_layers():
    return "--target-layer-ids must name at least one target layer."


@renders("train.drafter-target-layers", example=dict(outside=[36], num_target_layers=36))
def _drafter_target_layers(outside, num_target_layers):
    return f"Target layer ids {outside} are outside the target's layers 0..{num_target_layers - 1}."


@renders("train.drafter-mask-token", example=dict(mask_token_id=151936, vocab_size=151936))
def _drafter_mask_token(mask_token_id, vocab_size):
    return (f"mask_token_id {mask_token_id} is not a row of the target's embedding (vocab_size {vocab_size}); "
            "pick an unused or reserved token id below it (--mask-token-id).")


@renders("train.drafter-rope-theta", example={})
def _drafter_rope_theta():
    return "The drafter's rope_parameters must contain rope_theta (the target's RoPE base)."


@renders("train.drafter-sliding-window", example=dict(sliding_window=None))
def _drafter_sliding_window(sliding_window):
    return f"Sliding draft layers need a sliding window >= 1 (got {sliding_window}); pass --draft-sliding-window N."


@renders("train.attention-backend", example=dict(backend="xformers", choices=["auto", "sdpa", "flex"]))
def _attention_backend(backend, choices):
    return f"--attention-backend must be one of {', '.join(choices)}, got {backend!r}."


@renders("train.drafter-fields-unknown", example=dict(fields=["num_layers"]))
def _drafter_fields_unknown(fields):
    return f"Unknown DrafterConfig fields {fields}."


@renders("train.draft-layer-types", example=dict(spec="full,slide", bad=["slide"]))
def _draft_layer_types(spec, bad):
    return (f"--draft-layer-types {spec!r}: {bad or 'empty'} not one of full, sliding (or a comma-separated list "
            "of them, one per draft layer).")


@renders("train.draft-layer-types-count", example=dict(spec="full,sliding", given=2, layers=5))
def _draft_layer_types_count(spec, given, layers):
    return (f"--draft-layer-types {spec!r} names {given} layers but the drafter has {layers}; give one type for "
            "all layers or one per layer.")


@renders("train.compile-mode", example=dict(mode="fast", choices=["default", "max-autotune"]))
def _compile_mode(mode, choices):
    return f"--compile-mode must be one of {', '.join(choices)}, got {mode!r}."


@renders("train.flex-on-cpu", example=dict(flag="--attention-backend", device="cpu"))
def _flex_on_cpu(flag, device):
    return (f"{flag} flex trains on CUDA only: torch's FlexAttention has no backward pass on a {device.upper()}. "
            f"Use {flag} sdpa (or auto, which picks it on a {device.upper()}).")

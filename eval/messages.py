"""What dflash.eval tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import renders

_WHERE = "prompts.jsonl, line 3"


@renders("eval.flag-below-one", example=dict(flag="--batch-size", value=0))
def _flag_below_one(flag, value):
    return f"{flag} must be at least 1 (got {value})."


@renders("eval.block-size-range", example=dict(flag="--block-size", value=32, trained=16))
def _block_size_range(flag, value, trained):
    return f"{flag} {value} must be between 2 and the drafter's trained block size {trained}."


@renders("eval.prompt-file-missing", example=dict(file="prompts.jsonl"))
def _prompt_file_missing(file):
    return f"prompt file {file} does not exist."


@renders("eval.prompt-file-empty", example=dict(file="prompts.jsonl"))
def _prompt_file_empty(file):
    return f"prompt file {file} holds no prompts."


@renders("eval.prompt-not-json", example=dict(where=_WHERE, error="Expecting value"))
def _prompt_not_json(where, error):
    return f"{where} is not valid JSON ({error}); write one JSON object per line."


@renders("eval.prompt-not-object", example=dict(where=_WHERE, type="list"))
def _prompt_not_object(where, type):
    return f"{where}: expected a JSON object, got {type}."


@renders("eval.prompt-text-without-tokenizer", example=dict(where=_WHERE))
def _prompt_text_without_tokenizer(where):
    return (f"{where}: the record has only `text` and the target directory has no tokenizer; give `input_ids` or "
            "`prompt_ids` instead.")


@renders("eval.prompt-missing", example=dict(where=_WHERE))
def _prompt_missing(where):
    return f"{where}: the record has none of `prompt_ids`, `input_ids` or `text`."


@renders("eval.prompt-not-int-list", example=dict(where=_WHERE))
def _prompt_not_int_list(where):
    return f"{where}: token ids must be a list of integers."


@renders("eval.prompt-empty", example=dict(where=_WHERE))
def _prompt_empty(where):
    return f"{where}: the prompt is empty (the target needs at least one token)."


@renders("eval.prompt-out-of-vocab", example=dict(where=_WHERE, tokens=[70000], vocab_size=32000))
def _prompt_out_of_vocab(where, tokens, vocab_size):
    return (f"{where}: token ids {tokens} are outside the target's vocabulary (0..{vocab_size - 1}); the prompts "
            "were tokenized for another model.")


@renders("eval.prompt-past-positions", example=dict(
    where=_WHERE, prompt_len=20, positions="the target's 32 positions (max_position_embeddings 32 of its config)",
    limit=32, max_new_tokens=16, block_size=4))
def _prompt_past_positions(where, prompt_len, positions, limit, max_new_tokens, block_size):
    room = limit - prompt_len - block_size
    fix = (f"Lower --max-new-tokens to {room} or less, or shorten or leave out the prompt" if room >= 1
           else "Shorten or leave out the prompt")
    return (f"{where}: the prompt's {prompt_len:,} tokens, up to --max-new-tokens {max_new_tokens} more and a "
            f"verify block of {block_size} need up to {prompt_len + max_new_tokens + block_size:,} positions, more "
            f"than {positions}: past them its outputs, and the measurement, are out of the range it was trained "
            f"on. {fix}.")


@renders("eval.models-unloadable", example=dict(target="models/target", drafter="run/final", error="no config.json"))
def _models_unloadable(target, drafter, error):
    return f"cannot load the target {target} with the drafter {drafter}: {error}"


@renders("eval.drafter-layers-past-target", example=dict(layers=[1, 9, 17, 25, 33], target_layers=28))
def _drafter_layers_past_target(layers, target_layers):
    return (f"the drafter reads target layers {layers} but the target has {target_layers}; it was trained for "
            "another model.")


@renders("eval.drafter-without-confidence", example=dict(drafter="run/final", flag="--confidence-threshold"))
def _drafter_without_confidence(drafter, flag):
    where = f"{drafter}: " if drafter else ""  # (None: the decoding loop, which knows no directory)
    return (f"{where}{flag} stops drafting where the drafter's confidence falls, but this drafter predicts none (a "
            "DSpark drafter exported with its confidence head does): drop the flag.")


@renders("eval.output-diverged", example=dict(prompt_sets=["chat"]))
def _output_diverged(prompt_sets):
    return ("speculative output differs from the target's greedy output"
            + (f" on {', '.join(prompt_sets)}" if prompt_sets else "") + " (see docs/eval.md, 'The lossless check').")


@renders("eval.flag-out-of-range", example=dict(flag="--confidence-threshold", value=1.5, low=0, high=1))
def _flag_out_of_range(flag, value, low, high=None):
    bound = f"at least {low}" if high is None else f"between {low} and {high}"
    return f"{flag} must be {bound} (got {value})."


# -- target.py: what the target's cache allows -------------------------------------------------------


@renders("eval.target-unbatchable", example=dict(layers="sliding-window", flag="--batch-size", value=4))
def _target_unbatchable(layers, flag, value):
    return (f"the target has {layers} layers, whose state counts cache columns: batched speculative decoding "
            f"(rejected drafts leave holes) would change its output. Decode one prompt per batch ({flag} 1, "
            f"not {value}).")


@renders("eval.transformers-too-old", example=dict(version="4.57.1", needed="5"))
def _transformers_too_old(version, needed):
    return (f"the target has sliding-window layers and transformers {version} cannot roll their cache back after "
            f"rejected drafts; speculative decoding of it needs transformers {needed} or later.")


# -- dflash-eval's contract (eval/cli.py: runtime.cli's out-of-memory finding) ------------------


@renders("eval.out-of-memory", example=dict(command="dflash-eval", error="CUDA out of memory"))
def _out_of_memory(command, error):
    return (f"{command} ran out of device memory ({error}). Lower --batch-size (the prompts decoded at once) or "
            "--max-new-tokens, or free the device of other processes, then rerun.")

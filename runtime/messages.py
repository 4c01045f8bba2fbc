"""What dflash.runtime tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from .findings import renders

# -- records (runtime/records.py) ------------------------------------------------------------


@renders("runtime.file-changed-while-read", example=dict(file="data/train.jsonl", nbytes=1048576))
def _file_changed_while_read(file, nbytes):
    return (f"{file} changed while it was read: its first {nbytes:,} bytes no longer have the sha256 "
            "fingerprinted when the run started (the file was edited or truncated in place, not only "
            "appended to). What was read may mix both versions: restore the file, or pass --force to "
            "start anew from it as it is now.")


@renders("runtime.file-unreadable", example=dict(file="data/train.jsonl.gz", error="Compressed file ended early"))
def _file_unreadable(file, error):
    return f"{file}: cannot read the file ({error}). Check that it is complete and readable."


# A record's reasons (BadRecord): the reason only; the reader adds where (file, line) and the fix.
@renders("runtime.record-not-utf8", example=dict(offset=12))
def _record_not_utf8(offset):
    return f"the line is not valid UTF-8 (bad byte at offset {offset})"


@renders("runtime.record-not-json", example=dict(error="Expecting value", column=3))
def _record_not_json(error, column):
    return f"the line is not valid JSON ({error} at column {column})"


@renders("runtime.record-not-int-list", example=dict(key="input_ids", got="str"))
def _record_not_int_list(key, got):
    return f"{key} must be a list of integers, not {got}"


@renders("runtime.record-booleans", example=dict(key="loss_mask"))
def _record_booleans(key):
    return f"{key} must be a list of integers, not of booleans (true/false)"


@renders("runtime.record-not-flat", example=dict(key="input_ids"))
def _record_not_flat(key):
    return f"{key} must be a flat list of integers"


@renders("runtime.record-group-type", example=dict(value="[1, 2]"))
def _record_group_type(value):
    return f"group must be a string or an integer (got {value})"


@renders("runtime.record-not-object", example={})
def _record_not_object():
    return "the record must be a JSON object with input_ids and a loss mask"


@renders("runtime.record-no-input-ids", example={})
def _record_no_input_ids():
    return "the record has no input_ids"


@renders("runtime.record-empty", example={})
def _record_empty():
    return "the sample is empty (input_ids has no tokens)"


@renders("runtime.record-token-negative", example=dict(token=-3))
def _record_token_negative(token):
    return f"token id {token} is negative"


@renders("runtime.record-token-out-of-vocab", example=dict(token=151936, vocab_size=151936))
def _record_token_out_of_vocab(token, vocab_size):
    return f"token id {token} is outside the target's vocabulary ({vocab_size} entries)"


@renders("runtime.record-id-type", example={})
def _record_id_type():
    return "id must be a string or an integer"


@renders("runtime.record-length-mismatch", example=dict(key="loss_mask", entries=7, tokens=8))
def _record_length_mismatch(key, entries, tokens):
    return f"{key} has {entries} entries but input_ids has {tokens}"


@renders("runtime.record-mask-values", example={})
def _record_mask_values():
    return "loss_mask must hold only 0 and 1"


@renders("runtime.record-prompt-len", example=dict(tokens=12))
def _record_prompt_len(tokens):
    return f"prompt_len must be an integer between 0 and {tokens} (the sample length)"


@renders("runtime.record-no-loss-mask", example={})
def _record_no_loss_mask():
    return "the record has no loss mask: give loss_mask, labels or prompt_len"


@renders("runtime.sidecar-unreadable", example=dict(file="data/train.jsonl.meta.json", error="Expecting value: line 1"))
def _sidecar_unreadable(file, error):
    return (f"{file}: cannot read this data file's sidecar ({error}). Restore it, or rerun dflash-prepare / "
            "dflash-generate to write it again.")


@renders("runtime.sidecar-not-object", example=dict(file="data/train.jsonl.meta.json"))
def _sidecar_not_object(file):
    return (f"{file}: this data file's sidecar is not a JSON object. Restore it, or rerun dflash-prepare / "
            "dflash-generate to write it again.")


# -- config files (runtime/config.py) ----------------------------------------------------------


@renders("runtime.config-missing", example=dict(file="train.yaml"))
def _config_missing(file):
    return f"Config file {file} does not exist."


@renders("runtime.config-unreadable", example=dict(file="train.yaml", error="[Errno 13] Permission denied"))
def _config_unreadable(file, error):
    return f"Cannot read config file {file}: {error}."


@renders("runtime.config-yaml-missing", example=dict(file="train.yaml"))
def _config_yaml_missing(file):
    return f"{file} is YAML but PyYAML is not installed: `pip install pyyaml`, or write the config as JSON."


@renders("runtime.config-not-parsed", example=dict(file="train.json", format="JSON",
                                                  error="Expecting value: line 3 column 9 (char 40)"))
def _config_not_parsed(file, format, error):
    return f"{file} is not valid {format}: {error}"


@renders("runtime.config-repeated-key", example=dict(file="train.yaml", key="lr"))
def _config_repeated_key(file, key):
    return (f"{file} gives the key {key!r} twice: one of the two values would be dropped without a word. Keep the "
            "one you mean.")


@renders("runtime.config-not-mapping", example=dict(file="train.yaml"))
def _config_not_mapping(file):
    return f"{file} must hold a mapping of setting names to values."


@renders("runtime.config-key-deprecated", example=dict(file="train.yaml", key="lr", now="learning_rate"))
def _config_key_deprecated(file, key, now):
    return f"{file}: setting {key} is deprecated; it is {now} now."


@renders("runtime.config-key-twice", example=dict(file="train.yaml", key="token_budget", spelling="token-budget"))
def _config_key_twice(file, key, spelling):
    return f"{file} sets {key} twice (as {spelling!r} and another spelling); keep one."


@renders("runtime.config-unknown-keys", example=dict(file="train.yaml", unknown=["learning_rate"],
                                                    known=["lr", "epochs"]))
def _config_unknown_keys(file, unknown, known):
    return f"{file}: unknown setting(s) {', '.join(unknown)}. Known settings: {', '.join(known)}."


# -- settings: flags and config-file values (runtime/settings.py) -------------------------------


@renders("runtime.setting-invalid", example=dict(file="train.json", key="epochs", flag="--epochs", value="many",
                                                 reason="'many' is not a valid integer"))
def _setting_invalid(file, key, flag, value, reason):
    return (f"{file}: setting {key} = {value!r} is invalid: {reason}. Write a value that the flag {flag} takes "
            "(see --help), or leave the key out.")


def _typed(value):
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    return f"the {type(value).__name__} {value}"


@renders("runtime.setting-not-text", example=dict(file="extract.yaml", line=3, key="output", flag="--output",
                                                  value=493, item=None, written="0755", choices=None))
def _setting_not_text(file, line, key, flag, value, item, written, choices):
    """`written`: the value as the YAML file has it (None for JSON, where the file's own type shows)."""
    takes = f"one of {', '.join(choices)}" if choices else "a path or a name"
    if written is not None:
        why = (" (yes/no/on/off are booleans to YAML 1.1)" if isinstance(value, bool)
               else " (a leading 0 makes an octal number to YAML 1.1)" if written.lstrip("+-").startswith("0") else "")
        how, text = f"YAML reads the unquoted {written} as {_typed(value)}{why}", written
    else:
        how, text = f"the file gives {_typed(value)}", None if isinstance(value, bool) else str(value)
    spelled = "" if item is not None else f'"{key}": ' if str(file).endswith(".json") else f"{key}: "
    fix = f'Quote it: {spelled}"{text}"' if text is not None else "Write the text you mean, in quotes"
    where = f"{file}, line {line}" if line is not None else file
    shown = repr(value) if isinstance(value, (int, float)) else str(value)
    of_list = "" if item is None else f" (item {item} of its list)"
    return f"{where}: setting {key} = {shown}{of_list} is invalid: {key} takes text ({takes}), and {how}. {fix}."


@renders("runtime.setting-missing", example=dict(flags=["--cache", "--output-dir"]))
def _setting_missing(flags):
    return f"Missing {', '.join(flags)}: give it on the command line or in the --config file."


@renders("runtime.flag-deprecated", example=dict(flag="--num-draft-layers", now="--num-captured-layers"))
def _flag_deprecated(flag, now):
    return f"{flag} is deprecated: it is {now}."


@renders("runtime.flag-deprecated-and-new", example=dict(flag="--num-draft-layers", now="--num-captured-layers"))
def _flag_deprecated_and_new(flag, now):
    return f"{flag} is the deprecated name of {now}: give only {now}."


@renders("runtime.settings-invalid", example=dict(error="__init__() got an unexpected keyword argument 'x'"))
def _settings_invalid(error):
    return f"Invalid settings: {error}."


# -- devices and dtypes (runtime/devices.py) ---------------------------------------------------


@renders("runtime.dtype-unknown", example=dict(flag="--dtype", value="int8", allowed=["auto", "bf16", "fp16", "fp32"]))
def _dtype_unknown(flag, value, allowed):
    return f"{flag} {value!r} is not one of {', '.join(allowed)}."


@renders("runtime.device-invalid", example=dict(flag="--device", value="gpu", error="Expected one of cpu, cuda"))
def _device_invalid(flag, value, error):
    return f"{flag} {value!r} is not a torch device (e.g. cpu, cuda, cuda:1): {error}"


@renders("runtime.cuda-unavailable", example=dict(flag="--device", value="cuda:1"))
def _cuda_unavailable(flag, value):
    return f"{flag} {value} was asked for but CUDA is not available; use {flag} cpu (or leave it out)."


# -- writer locks (runtime/locks.py) -----------------------------------------------------------


# (what, fix) of each lock purpose (runtime.locks.PURPOSES); {output} is the thing written.
_CACHE, _WAIT_OTHER = "The cache at {output}", "wait for the other writer to finish or stop it, then rerun"
LOCK_WORDS = {
    "run": ("The run directory {output}", "Two runs cannot share an --output-dir: wait for that run to finish or "
            "stop it, or choose another --output-dir."),
    "export": ("The export directory {output}", "Wait for that dflash-train export to finish or stop it, then rerun."),
    "prepare": ("The output {output}", "Wait for that dflash-prepare to finish or stop it, or choose another --output."),
    "generate": ("The output {output}", "Wait for that dflash-generate to finish or stop it, or choose another "
                 "--output."),
    "quarantine": (_CACHE, "Quarantine rewrites its commit log: wait for that process to finish or stop it, then "
                   "rerun `dflash-cache verify --quarantine`."),
    "extract": (_CACHE, "It is being started anew (--force); rerun once that run has begun."),
    "extract-force": (_CACHE, "--force deletes the cache, which another extraction is writing: wait for it to finish "
                      "or stop it, then rerun (or choose another --output)."),
    "import": (_CACHE, f"dflash-cache import writes the cache alone: {_WAIT_OTHER} (or choose another output "
               "directory)."),
    "recompress": (_CACHE, f"recompress writes the destination cache alone: {_WAIT_OTHER} (or choose another "
                   "destination)."),
    "merge": (_CACHE, f"merge writes the destination cache alone: {_WAIT_OTHER} (or choose another destination)."),
}


@renders("runtime.locked", example=dict(purpose="extract-force", output="runs/cache", holder="pid 4242 on node-1",
                                        lock_file="runs/cache/.writer.lock"))
def _locked(purpose, output, holder, lock_file):
    what, fix = LOCK_WORDS[purpose]
    return (f"{what.format(output=output)} is being written by another process ({holder or 'holder unknown'}; "
            f"lock file {lock_file}). {fix}")


@renders("runtime.output-is-input", example=dict(flag="--output", output="data/a.jsonl", input=None,
                                                 input_flag="--data"))
def _output_is_input(flag, output, input, input_flag):
    which = "the input" if input is None else f"the input file {input}"
    return (f"{flag} {output} is {which} ({input_flag}): writing it would overwrite the data being read. "
            f"Choose another {flag}.")


# -- weight files (runtime/safetensors_files.py) -----------------------------------------------
# A safetensors file's reasons (safetensors_problem): the reason only; runtime.weights-file-damaged
# names the file and the fix.


@renders("runtime.safetensors-short", example=dict(size=5))
def _safetensors_short(size):
    return f"{size} bytes, shorter than the 8-byte header length"


@renders("runtime.safetensors-header-size", example=dict(header=4096, size=1000))
def _safetensors_header_size(header, size):
    return f"its header claims {header} bytes but the file has {size}"


@renders("runtime.safetensors-unreadable", example=dict(error="Permission denied"))
def _safetensors_unreadable(error):
    return f"cannot be read ({error})"


@renders("runtime.safetensors-header-not-json", example=dict(error="Expecting value: line 1 column 1 (char 0)"))
def _safetensors_header_not_json(error):
    return f"its header is not valid JSON ({error})"


@renders("runtime.safetensors-header-not-object", example={})
def _safetensors_header_not_object():
    return "its header is not a JSON object"


@renders("runtime.safetensors-offsets", example=dict(tensor="lm_head.weight", offsets=[10, 4]))
def _safetensors_offsets(tensor, offsets):
    if offsets is None:
        return f"tensor {tensor!r} has no valid data_offsets"
    return f"tensor {tensor!r} has data_offsets {offsets[0]}, {offsets[1]}"


@renders("runtime.safetensors-data-size", example=dict(needed=4096, holds=2048))
def _safetensors_data_size(needed, holds):
    return f"its tensors need {needed} bytes of data but the file holds {holds}" + (
        " (truncated)" if needed > holds else "")


# What to do about a damaged file, by what it holds (runtime.safetensors_files.WEIGHT_PURPOSES).
WEIGHTS_FIX = {
    "target": "Copy the target model's weight files again (a copy that stopped or a full disk leaves them short), "
              "then rerun.",
    "drafter": "Export the drafter again (dflash-train export CHECKPOINT OUT_DIR), or copy the directory again.",
    "resume": "Delete that checkpoint to resume from the one before, or start in a new --output-dir.",
    "export": "Export an earlier checkpoint of the run (RUN_DIR/checkpoints/step-N).",
}


@renders("runtime.weights-file-damaged", example=dict(file="model/model.safetensors", problem="its header is not "
                                                      "a JSON object", purpose="target"))
def _weights_file_damaged(file, problem, purpose):
    return f"{file} is not a complete safetensors file: {problem}. {WEIGHTS_FIX[purpose]}"


@renders("runtime.drafter-as-target", example=dict(dir="runs/a/final", architectures=["DFlash2DraftModel"],
                                                   flag="--target-model"))
def _drafter_as_target(dir, architectures, flag):
    return (f"{dir} is a DFlash drafter export (config.json architectures {architectures}), not a target model: "
            f"pass the target model the drafter drafts for as {flag} (a drafter goes to dflash-eval's --drafter).")


@renders("runtime.weights-incomplete", example=dict(dir="models/qwen3", flag="--target-model",
                                                    missing=["model.layers.1.mlp.up_proj.weight"], mismatched=[]))
def _weights_incomplete(dir, flag, missing, mismatched):
    bad = [*missing, *mismatched]
    shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    what = " and ".join(x for x in (f"{len(missing)} missing" if missing else "",
                                    f"{len(mismatched)} of another shape" if mismatched else "") if x)
    return (f"The weights of {dir} ({flag}) do not hold every tensor its config.json needs: {what} ({shown}). The "
            "loader would fill them with random values, and everything computed from the model would be a "
            "half-random one's. Copy the model's complete weight files (every shard named in "
            f"model.safetensors.index.json) into that directory, or point {flag} to the model they belong to.")


# -- every command's contract (runtime/cli.py): a command's package may render its own ---------


@renders("runtime.stopped", example=dict(command="dflash-cache", signal="SIGINT"))
def _stopped(command, signal):
    return f"{command} stopped by {signal}."


@renders("runtime.os-error", example=dict(error="No space left on device", file="runs/cache/parts/p-00001"))
def _os_error(error, file):
    where = f" ({file})" if file else ""
    return f"{error}{where}. Check the path, its permissions and the free disk space, then rerun the command."


@renders("runtime.compile-failed", example=dict(command="dflash-x", error="CompilationError: at 12:4: ..."))
def _compile_failed(command, error):
    return (f"{command}: torch.compile failed to build its kernels ({error}). This is torch's compiler or its "
            "toolchain (a C++ compiler, Triton) on this machine, not your data: report the traceback above, and run "
            "without compiling meanwhile if the command has a flag for it.")


@renders("runtime.out-of-memory", example=dict(command="dflash-x", error="CUDA out of memory"))
def _out_of_memory(command, error):
    return (f"{command} ran out of device memory ({error}). Give the command less to hold at once (a smaller batch or "
            "token budget), or free the device of other processes (nvidia-smi lists them), then rerun it.")

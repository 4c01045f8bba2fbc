"""What dflash.train.exports (and dflash-train's commands) tell their user: one renderer per
finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import Finding, renders

_EXPORT = "config.json and model.safetensors"
_FIX_OUT = ("Choose a new or empty directory, or remove that one yourself if nothing in it is needed, and export "
            "again.")
_FIX_WEIGHTS = "Export the drafter again (dflash-train export CHECKPOINT OUT_DIR), or copy the directory again."


# How each purpose of an export directory (export.export_out_dir) is named, and what to do with one
# that holds other files (None: _FIX_OUT).
OUT_DIR_WORDS: dict[str, tuple[str, str | None]] = {
    "export": ("The export directory", None),
    "command": ("OUT_DIR", None),
    "run-final": ("The run's export directory", "Move those files out of it, or choose another --output-dir."),
}


def _named(purpose: str, path: str, absolute: str | None) -> str:
    return f"{OUT_DIR_WORDS[purpose][0]} {path}" + (f" ({absolute})" if absolute else "")


def _out_fix(purpose: str) -> str:
    return OUT_DIR_WORDS[purpose][1] or _FIX_OUT


def _then_now(differences: list) -> str:
    return "; ".join(f"{key} {str(then)[:16]} when trained, {str(now)[:16]} here" for key, then, now in differences)


# -- export.py: writing an export --------------------------------------------------------------


@renders("train.export-out-holds-cwd", example=dict(purpose="command", path=".", absolute="/home/me", root=False,
                                                    instead="drafter"))
def _out_holds_cwd(purpose, path, absolute, root, instead):
    return (f"{_named(purpose, path, absolute)} is {'the file-system root' if root else 'the current directory or holds it'}: "
            "an export replaces its directory whole, which would delete what is there (or leave your shell in a "
            f"deleted directory). Name a new directory for it instead (e.g. {instead}).")


@renders("train.export-out-is-file", example=dict(purpose="command", path="out", absolute=None))
def _out_is_file(purpose, path, absolute):
    return (f"{_named(purpose, path, absolute)} is a file, not a directory: an export is a directory of {_EXPORT}. "
            f"{_out_fix(purpose)}")


@renders("train.export-out-holds-files", example=dict(purpose="run-final", path="out", absolute=None,
                                                      files=["notes/", "todo.txt"], more=0))
def _out_holds_files(purpose, path, absolute, files, more):
    listing = ", ".join(files) + (f" and {more} more" if more else "")
    return (f"{_named(purpose, path, absolute)} already holds files that are not a drafter export ({listing}): an "
            "export replaces its directory whole, so they would be deleted. It replaces only an empty directory "
            f"or an earlier export (just config.json of a DFlash drafter, model.safetensors and the README.md "
            f"written with them). {_out_fix(purpose)}")


@renders("train.export-dtype", example=dict(dtype="torch.int8", choices=["float32", "bfloat16", "float16"]))
def _export_dtype(dtype, choices):
    return f"An export's dtype must be one of {', '.join(choices)}, not {dtype}."


# -- export.py: reading an export ----------------------------------------------------------------


@renders("train.export-missing", example=dict(dir="runs/x/final"))
def _export_missing(dir):
    return (f"{dir} is not a drafter export: it needs {_EXPORT} (or the shards model.safetensors.index.json "
            "names).")


@renders("train.export-no-weights", example=dict(dir="runs/x/final"))
def _export_no_weights(dir):
    return f"{dir} holds no model.safetensors (nor the shards of model.safetensors.index.json)."


@renders("train.export-not-dflash", example=dict(file="target/config.json", architectures=["Qwen3ForCausalLM"]))
def _export_not_dflash(file, architectures):
    return (f"{file} is not a DFlash drafter config (no dflash_config, architectures {architectures}); pass the "
            "directory written by dflash-train export.")


@renders("train.export-no-num-target-layers", example={})
def _export_no_num_target_layers():
    return "The export's config.json lacks num_target_layers; pass the target directory."


@renders("train.export-index-unreadable", example=dict(file="d/model.safetensors.index.json",
                                                       error="Expecting value: line 1 column 1 (char 0)"))
def _export_index_unreadable(file, error):
    return f"{file} is not a safetensors index ({error}). {_FIX_WEIGHTS}"


@renders("train.export-shard-missing", example=dict(file="d/model-00002-of-00002.safetensors",
                                                    index="d/model.safetensors.index.json"))
def _export_shard_missing(file, index):
    return f"{file} is missing: {index} names it. {_FIX_WEIGHTS}"


@renders("train.export-tensor-twice", example=dict(tensor="fc.weight", dir="d", shard="model-00002.safetensors"))
def _export_tensor_twice(tensor, dir, shard):
    return f"Tensor {tensor} is in two shards of {dir} ({shard} is one). {_FIX_WEIGHTS}"


@renders("train.export-weights-mismatch", example=dict(file="d/model.safetensors", missing=["fc.weight"],
                                                       unexpected=[]))
def _export_weights_mismatch(file, missing, unexpected):
    return (f"The weights in {file} do not match the drafter its config.json describes: missing {missing}, "
            f"unexpected {unexpected}. {_FIX_WEIGHTS}")


@renders("train.drafter-target-size", example=dict(drafter="d", target="models/other", drafter_sizes=[64, 256],
                                                   target_sizes=[64, 512]))
def _drafter_target_size(drafter, target, drafter_sizes, target_sizes):
    return (f"The drafter in {drafter} has hidden_size {drafter_sizes[0]} / vocab_size {drafter_sizes[1]} but the "
            f"target in {target} has {target_sizes[0]} / {target_sizes[1]}; load it with the target it was "
            "trained for.")


@renders("train.drafter-other-target", example=dict(drafter="runs/x/final", trained="/models/a", here="/models/b",
                                                    differences=[("weights_hash", "3f2a", "91c0")]))
def _drafter_other_target(drafter, trained, here, differences):
    return (f"the drafter {drafter} was trained against another target ({trained or 'where it lay is not recorded'}) "
            f"than {here}: {_then_now(differences)}. Its acceptance here measures a drafter of other hidden states; "
            "evaluate it with the target it was trained against, or train one for this target.")


# -- drafter_layouts.py: another trainer's drafter ---------------------------------------------------


@renders("train.drafter-no-config", example=dict(dir="runs/x/checkpoints/step-10"))
def _drafter_no_config(dir):
    return f"{dir} is not a drafter export: it has no config.json."


@renders("train.drafter-config-not-json", example=dict(file="d/config.json", error="Expecting value"))
def _drafter_config_not_json(file, error):
    return f"{file} is not JSON ({error})."


@renders("train.drafter-layout-unknown", example=dict(file="d/config.json", layouts=["speculators", "export"],
                                                      architectures=["LlamaForCausalLM"]))
def _drafter_layout_unknown(file, layouts, architectures):
    return (f"{file} is no DFlash-family drafter of a layout this trainer reads ({', '.join(layouts)}): "
            f"architectures {architectures}.")


@renders("train.drafter-draft-vocab-tensor", example=dict(tensor="d2t"))
def _drafter_draft_vocab_tensor(tensor):
    return (f"It drafts over a reduced vocabulary (its tensor {tensor}, draft_vocab_size below the target's): "
            "this trainer's drafters draft over the target's vocabulary with its lm_head.")


@renders("train.drafter-anchor-drafts", example=dict(key="dflash_config.shift_label"))
def _drafter_anchor_drafts(key):
    return (f"Its {key} is true: its anchor slot drafts too, so its slot k predicts the token this trainer's "
            "drafters predict at slot k+1 (the anchor is the verified token here); its weights would start every "
            "slot one token off.")


@renders("train.drafter-layer-config", example=dict(error="unknown model_type"))
def _drafter_layer_config(error):
    return f"Its transformer_layer_config cannot be read ({error})."


@renders("train.drafter-head-unknown", example=dict(key="speculators_model_type", value="eagle3",
                                                    heads=["dflash", "dflash2"]))
def _drafter_head_unknown(key, value, heads):
    return f"Its {key} {value!r} names no drafter head of this trainer (the heads are {', '.join(heads)})."


@renders("train.drafter-draft-vocab", example=dict(draft_vocab=32000, vocab=151936))
def _drafter_draft_vocab(draft_vocab, vocab):
    return (f"Its draft_vocab_size {draft_vocab} differs from its vocab_size {vocab}: it drafts over a reduced "
            "vocabulary with its own lm_head; this trainer's drafters draft over the target's.")


@renders("train.drafter-target-hidden", example=dict(target_hidden=4096, hidden=2048))
def _drafter_target_hidden(target_hidden, hidden):
    return (f"Its target_hidden_size {target_hidden} differs from its hidden_size {hidden}: this trainer's "
            "drafters are as wide as the target.")


@renders("train.drafter-no-aux-layers", example={})
def _drafter_no_aux_layers():
    return "Its config.json names no aux_hidden_state_layer_ids (the target layers it reads)."


@renders("train.drafter-aux-embedding", example=dict(aux=[0, 2, 4]))
def _drafter_aux_embedding(aux):
    return (f"Its aux_hidden_state_layer_ids {aux} include 0, the embedding output (speculators counts it as "
            "layer 0): this trainer's caches hold the outputs of the target's layers only.")


@renders("train.drafter-attention-mode", example=dict(mode="mla"))
def _drafter_attention_mode(mode):
    return f"Its dflash_config.attention_mode {mode!r} is not this trainer's: its drafters attend as GQA/MHA."


# -- train/cli.py: dflash-train ------------------------------------------------------------------------


@renders("train.compare-moved", example=dict(command="dflash-compare"))
def _compare_moved(command):
    return f"The head comparison is its own command now: {command}, with the same options ({command} --help)."


# dflash-train's (and dflash-compare's) contract: runtime.cli's stop, OSError and out-of-memory findings.


@renders("train.stopped", example=dict(command="dflash-train", signal="SIGTERM"))
def _stopped(command, signal):
    return (f"{command} stopped by {signal} outside a training step; complete checkpoints are kept. Rerun the same "
            "command to resume.")


@renders("train.os-error", example=dict(error="No space left on device", file="runs/a/checkpoints/step-100"))
def _os_error(error, file):
    where = f" ({file})" if file else ""
    return (f"{error}{where}. Check the path, its permissions and the free disk space, then rerun the same command to "
            "resume.")


@renders("train.compile-failed", example=dict(command="dflash-train", error="CompilationError: at 12:4: ..."))
def _compile_failed(command, error):
    return (f"{command}: torch.compile failed to build the training step's kernels ({error}). This is torch's "
            "compiler or its toolchain (Triton, a C++ compiler) on this machine, not your data or settings: rerun the "
            "same command with --no-compile, which trains the same arithmetic eagerly, slower, and resumes from the "
            "complete checkpoints; and report the traceback above.")


@renders("train.out-of-memory", example=dict(command="dflash-train", error="CUDA out of memory"))
def _out_of_memory(command, error):
    return (f"{command} ran out of device memory ({error}). A micro-batch holds --token-budget padded tokens and up to "
            "--max-anchors blocks of --block-size per sample. Hold less at once: pass --gradient-checkpointing or a "
            "lower --logits-chunk-mib (the head's logits held at once), which a rerun may change and still resume "
            "from the complete checkpoints; or lower --max-anchors, or --token-budget or --max-batch-size, which "
            "change the batches and so start a new run (another --output-dir).")


# -- warm_start.py: --init-drafter ----------------------------------------------------------------


def _cause(cause: Finding | str) -> str:
    return str(cause).rstrip(".") + "."


@renders("train.init-drafter-missing", example=dict(init="runs/x/checkpoints/step-10",
                                                    cause=Finding("train.drafter-no-config", dir="runs/x")))
def _init_drafter_missing(init, cause):
    return (f"--init-drafter {init}: {_cause(cause)} To start from a checkpoint, export it first: dflash-train "
            "export CHECKPOINT OUT_DIR.")


@renders("train.init-drafter-unreadable", example=dict(init="d", cause=Finding("train.drafter-no-aux-layers")))
def _init_drafter_unreadable(init, cause):
    return f"--init-drafter {init} cannot start this run. {_cause(cause)} Pass another drafter, or drop --init-drafter."


@renders("train.init-drafter-misfit", example=dict(
    init="d", layout="the DFlash export layout", target_model="/models/t", target=[],
    settings=[("--num-draft-layers", 2, 1)], shapes=[("fc.weight", (64, 128), (64, 192))], missing=["norm.weight"],
    unexpected=[]))
def _init_drafter_misfit(init, layout, target_model, target, settings, shapes, missing, unexpected):
    found = ([f"{field} {there} there, {value} in the target {target_model}" for field, there, value in target]
             + [f"{flag} {here} here, {there} there" for flag, here, there in settings]
             + [f"{name} {there} there, {here} here" for name, there, here in shapes[:4]]
             + ([f"missing {missing[:4]}"] if missing else [])
             + ([f"not in this drafter {unexpected[:4]}"] if unexpected else []))
    return (f"--init-drafter {init} ({layout}) does not fit this run's drafter: {'; '.join(found)}. Fix: pass a "
            "drafter of this target with this run's shape (dflash-train export CHECKPOINT OUT_DIR makes one of a "
            "checkpoint), set the flags above to the drafter's, or drop --init-drafter.")


@renders("train.init-drafter-on-resume", example=dict(init="d", checkpoint="runs/x/checkpoints/step-100"))
def _init_drafter_on_resume(init, checkpoint):
    return (f"No warm start: the run resumes from {checkpoint}, whose weights win; --init-drafter {init} is "
            "ignored on resume (a new --output-dir starts from it).")


@renders("train.init-drafter-target-unrecorded", example=dict(init="d"))
def _init_drafter_target_unrecorded(init):
    return (f"--init-drafter {init}'s config.json records no target it was trained against, so whether that is "
            "this run's target is not checked.")


@renders("train.init-other-target", example=dict(init="d", trained="/models/a", here="/models/b",
                                                 differences=[("config_hash", "3f2a", "91c0")]))
def _init_other_target(init, trained, here, differences):
    return (f"--init-drafter {init} was trained against another target ({trained or 'where it lay is not recorded'}) "
            f"than this run's ({here}): {_then_now(differences)}; its weights fit this drafter and are loaded, so the "
            "run starts from that target's drafter (pass an export of a run on this target if that is not what "
            "you meant).")

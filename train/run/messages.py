"""What dflash.train's run (train/run/) tells its user: one renderer per finding code
(`dflash.runtime.findings`). Code states findings; the words live here."""

from __future__ import annotations

from dflash.runtime.findings import renders


@renders("train.nothing-to-learn", example=dict(samples=12, longest=1, block_size=16))
def _nothing_to_learn(samples, longest, block_size):
    return (f"Nothing to learn: every one of the {samples} training samples is {longest} token long, and a block "
            f"(--block-size {block_size}) starts at a token of the completion and predicts the next, so a sample "
            "needs 2 tokens at least. Extract the full completions (check the data's input_ids and --max-seq-len of "
            "dflash-extract) and train on that cache.")


@renders("train.target-config-unreadable", example=dict(target="models/Qwen3-8B",
                                                        error="models/Qwen3-8B/config.json: No such file or directory"))
def _target_config_unreadable(target, error):
    return f"Cannot read the target model's config: {error}"


@renders("train.soft-labels-not-in-cache", example=dict(weight=0.5, cache="cache"))
def _soft_labels_not_in_cache(weight, cache):
    return (f"--soft-label-weight {weight} needs soft labels in the cache, but {cache} stores neither last_hidden "
            "nor top-k log-probs. Extract with --store-last-hidden or --store-topk, or set --soft-label-weight 0.")


@renders("train.drafter-unbuildable", example=dict(target="models/Qwen3-8B", error="no lm_head weight"))
def _drafter_unbuildable(target, error):
    return f"Cannot build the drafter from {target}: {error}"


@renders("train.final-dir-foreign", example=dict(final="run/final"))
def _final_dir_foreign(final):
    return (f"The run's export directory {final} holds files that are not a drafter export (rank 0 says which): "
            "move them out of it, or choose another --output-dir.")


@renders("train.best-checkpoint-gone", example=dict(checkpoint="run/checkpoints/step-000400"))
def _best_checkpoint_gone(checkpoint):
    return f"The best held-out checkpoint {checkpoint} is gone; exporting the last step's weights instead."


@renders("train.max-steps-cut", example=dict(max_steps=6, step=6, epoch=2, epochs=3, epoch_step=2, epoch_steps=4,
                                             all_steps=12, first_epoch_share=None))
def _max_steps_cut(max_steps, step, epoch, epochs, epoch_step, epoch_steps, all_steps, first_epoch_share):
    where = "at the end of" if epoch_step == epoch_steps else "partway through"
    within = f" (step {epoch_step} of its {epoch_steps})" if epoch_step < epoch_steps else ""
    unseen = (f"; about {100 * first_epoch_share:.0f} % of the first epoch: some samples go untrained"
              if first_epoch_share is not None else "")
    return (f"--max-steps {max_steps} ends the run at step {step}, {where} epoch {epoch} of {epochs}{within}; all "
            f"{epochs} epoch(s) take {all_steps} steps{unseen}")


@renders("train.resume-compute-changed", example=dict(changes=[["cpu_threads", 16, 8]]))
def _resume_compute_changed(changes):
    diffs = ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changes)
    return (f"compute settings changed since that checkpoint ({diffs}): training continues correctly, but not "
            "bit-identically to an uninterrupted run (kernels sum in another order). For an exact continuation "
            "resume with the same torch, thread count (OMP_NUM_THREADS) and hardware.")


@renders("train.trainer-state-version", example=dict(version=9, current=2))
def _trainer_state_version(version, current):
    return f"The checkpoint's trainer state has version {version}; this dflash-train reads versions 1 and {current}."


@renders("train.keep-checkpoints-too-low", example=dict(value=0))
def _keep_checkpoints_too_low(value):
    return "--keep-checkpoints must be at least 1."


@renders("train.checkpoint-version", example=dict(checkpoint="run/checkpoints/step-000400", version=2, current=1))
def _checkpoint_version(checkpoint, version, current):
    return f"Checkpoint {checkpoint} has version {version}; this dflash-train reads version {current}."


_DELETE_IT = "to resume from the one before, or start in a new --output-dir."


@renders("train.checkpoint-unreadable", example=dict(checkpoint="run/checkpoints/step-000400",
                                                     error="Expecting value: line 1 column 1 (char 0)"))
def _checkpoint_unreadable(checkpoint, error):
    return f"Checkpoint {checkpoint} cannot be read ({error}). Delete it {_DELETE_IT}"


@renders("train.checkpoint-pickled", example=dict(file="run/checkpoints/step-000400/trainer.pt",
                                                  checkpoint="run/checkpoints/step-000400", pickled="os.system"))
def _checkpoint_pickled(file, checkpoint, pickled):
    what = f"a pickled {pickled}" if pickled else "pickled objects"
    return (f"Checkpoint file {file} holds {what}, not plain data (tensors, numbers, strings, lists, dicts), so it "
            "is not loaded: unpickling it could run code. dflash-train writes only plain data there, so this file "
            f"was written by another program or altered. Delete its directory {checkpoint} {_DELETE_IT}")


@renders("train.resume-other-run", example=dict(
    checkpoint="run/checkpoints/step-000400", differences=[["batching.token_budget", "128", "96"]],
    grown=False, default_head=["dflash", "dflash2"]))
def _resume_other_run(checkpoint, differences, grown, default_head):
    shown = "; ".join(f"{key}: checkpoint has {saved}, this run has {now}" for key, saved, now in differences[:8])
    shown += "; ..." if len(differences) > 8 else ""
    text = (f"Cannot resume from {checkpoint}: it was trained with other data, target or batching/model settings: "
            f"{shown}.")
    if grown:
        text += (" A cache holds other samples than when the checkpoint was written (was it still being extracted? "
                 "`dflash-train --follow` trains on a cache while it is written).")
    if default_head:
        from dflash.train.heads import get_head

        was, now = (get_head(name) for name in default_head)
        text += (f" The checkpoint is a {was.title} drafter and this run a {now.title} one: the default "
                 f"--drafter-type became {now.name} after it started (docs/recipe.md); pass --drafter-type {was.name} "
                 "to finish it as it started, or export it (dflash-train export CHECKPOINT OUT_DIR) and start a "
                 f"{now.title} run from it in a new --output-dir with --init-drafter OUT_DIR.")
    return text + " Rerun with the checkpoint's settings, or start a new run with another --output-dir."


@renders("train.export-no-checkpoint", example=dict(run_dir="run"))
def _export_no_checkpoint(run_dir):
    return f"{run_dir} holds no complete checkpoint to export."


@renders("train.export-not-checkpoint", example=dict(path="run/final", needs=["meta.json", "model.safetensors"]))
def _export_not_checkpoint(path, needs):
    return (f"{path} is not a dflash-train checkpoint: it needs {' and '.join(needs)} (pass "
            "RUN_DIR/checkpoints/step-N or the run directory).")


@renders("train.export-out-is-checkpoint", example=dict(out="run", checkpoint="run/checkpoints/step-000400",
                                                        same=False))
def _export_out_is_checkpoint(out, checkpoint, same):
    return (f"OUT_DIR {out} {'is' if same else 'holds'} the checkpoint being exported ({checkpoint}): the export "
            "would replace it. Choose another OUT_DIR.")


@renders("train.resume-no-checkpoint", example=dict(checkpoints="run/checkpoints"))
def _resume_no_checkpoint(checkpoints):
    return f"--resume was given but {checkpoints} holds no complete checkpoint."


@renders("train.metrics-set-aside", example=dict(file="run/metrics.jsonl", aside="metrics.jsonl.1"))
def _metrics_set_aside(file, aside):
    return (f"{file} held the records of an earlier run in this directory, whose checkpoints are gone: moved to "
            f"{aside}, so that this run's steps do not mix with them.")


@renders("train.metrics-dropped", example=dict(file="run/metrics.jsonl", records=3, step=400))
def _metrics_dropped(file, records, step):
    return (f"{file}: dropped {records} record(s) of steps after {step}, logged by the run that stopped before "
            "checkpointing them; this run logs those steps again.")


@renders("train.resume-settings-changed", example=dict(changes=[["epochs", 6, 10], ["lr", 0.0006, 0.0003]],
                                                       former_defaults=[["epochs", 6]]))
def _resume_settings_changed(changes, former_defaults):
    text = "settings changed since that checkpoint: " + ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changes)
    if former_defaults:
        keys = ", ".join(k for k, _ in former_defaults)
        flags = " ".join(f"--{k.replace('_', '-')} {value}" for k, value in former_defaults)
        text += (f" ({keys}: the default changed since this run started, docs/recipe.md; rerun with {flags} to "
                 "finish it as it started)")
    return text


def _micro_batch(batch):
    return f"{batch['samples']} sample(s) of {batch['tokens']:,} tokens with {batch['anchors']:,} anchors"


_LONG_SAMPLES = 'docs/train.md, "Long samples"'


@renders("train.logits-chunk-lowered", example=dict(
    batch=dict(samples=1, tokens=32768, anchors=512), needed_gib=96.4, was=8192, usable_gib=72.0,
    device="NVIDIA H100 80GB HBM3 (free at startup)", logits_chunk_mib=1024, lowered_gib=61.8))
def _logits_chunk_lowered(batch, needed_gib, was, usable_gib, device, logits_chunk_mib, lowered_gib):
    return (f"GPU memory: the largest micro-batch ({_micro_batch(batch)}) needs about {needed_gib:.0f} GiB with the "
            f"target head's logits at once (--logits-chunk-mib {was}), more than the {usable_gib:.0f} GiB usable on "
            f"{device}: --logits-chunk-mib {logits_chunk_mib} for this run ({lowered_gib:.0f} GiB; {_LONG_SAMPLES})")


_FIX_SAYS = {"--gradient-checkpointing": "--gradient-checkpointing (each draft layer's forward runs twice)",
             "--max-seq-len": "--max-seq-len {} (truncating the longer samples)"}


@renders("train.memory-over-budget", example=dict(
    batch=dict(samples=64, tokens=512, anchors=32704),
    settings={"--token-budget": 32768, "--max-batch-size": 64, "--max-anchors": 512, "--max-seq-len": 32768},
    needed_gib=212.0, usable_gib=73.0, device="NVIDIA H100 80GB HBM3 (free at startup)", largest="head",
    largest_gib=120.0, fits={"--max-batch-size": 18, "--gradient-checkpointing": True}))
def _memory_over_budget(batch, settings, needed_gib, usable_gib, device, largest, largest_gib, fits):
    said = [_FIX_SAYS[flag].format(value) if flag in _FIX_SAYS else f"{flag} {value}"
            for flag, value in fits.items()]
    what = ("pass " + ", or ".join(said) if said else
            "no single setting brings it under: combine --gradient-checkpointing with a lower --max-batch-size and "
            "--max-seq-len, or train on a GPU with more memory")
    shown = ", ".join(f"{flag} {value}" for flag, value in settings.items())
    return (f"The largest micro-batch of this run ({_micro_batch(batch)}: {shown}) needs about {needed_gib:.0f} GiB "
            f"of GPU memory, more than the {usable_gib:.0f} GiB usable on {device} (largest: {largest}, "
            f"{largest_gib:.0f} GiB). To fit, {what}. The estimate and its terms: {_LONG_SAMPLES}; --no-memory-check "
            "skips it.")


@renders("train.loss-diverged", example=dict(step=37, loss=float("nan"), grad_norm=float("inf"), lr=0.05,
                                             default_lr=0.0006, checkpoint="run/checkpoints/step-000030",
                                             final="run/final", final_kept=False, grad_clip_off=False))
def _loss_diverged(step, loss, grad_norm, lr, default_lr, checkpoint, final, final_kept, grad_clip_off):
    seen = f" (logged: loss={loss:.4g}, grad_norm={grad_norm:.4g})" if loss is not None else ""
    kept = (f"the last checkpoint, {checkpoint}, is from before it and is kept" if checkpoint is not None
            else "no checkpoint was written before it")
    exported = f"{final} is as it was" if final_kept else f"nothing was exported to {final}"
    resume = (", or the same command with the lower --lr to resume from that checkpoint (one written shortly before "
              "the divergence may hold weights already far off)" if checkpoint is not None else "")
    steady = ("A --grad-clip (0 turns clipping off) and a longer --warmup-ratio also steady the first steps"
              if grad_clip_off else "A longer --warmup-ratio also steadies the first steps")
    return (f"The loss diverged at step {step}: the training loss or gradient norm became nan or inf{seen}, and from "
            "there every weight of the drafter turns nan. The run stopped without checkpointing or exporting those "
            f"weights: {kept}; {exported}. Rerun with a lower --lr (this run's is {lr:g}; the default is "
            f"{default_lr:g}): in a new --output-dir to start over{resume}. {steady}.")

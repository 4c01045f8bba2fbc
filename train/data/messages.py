"""What dflash.train's data (train/data/) tells its user: one renderer per finding code
(`dflash.runtime.findings`). Code states findings; the words live here."""

from __future__ import annotations

from dflash.runtime.findings import renders

_ELSEWHERE = "Give a cache extracted from other data as --eval-cache, or leave it out (a held-out split of --cache is used)."


@renders("train.cache-other-target", example=dict(
    cache="cache", target="models/Qwen3-8B", differences=[["architecture", "'LlamaForCausalLM'", "'Qwen3ForCausalLM'"]],
    missing_layers=[40], num_layers=36))
def _cache_other_target(cache, target, differences, missing_layers, num_layers):
    shown = [f"{key}: cache has {found}, target has {want}" for key, found, want in differences]
    if missing_layers:
        shown.append(f"target_layer_ids {missing_layers} do not exist in a {num_layers}-layer target")
    return (f"The cache at {cache} was not extracted from the target model at {target}: {'; '.join(shown)}. "
            "Pass the --target-model the cache was extracted with.")


@renders("train.cache-long-samples", example=dict(cache="cache", samples=2, longest=40_960, limit=32_768,
                                                  source="max_position_embeddings 32768"))
def _cache_long_samples(cache, samples, longest, limit, source):
    return (f"The cache at {cache} holds {samples} sample(s) longer than the target's {limit:,} positions ({source} "
            f"of its config), the longest {longest:,} tokens: their hidden states past position {limit:,} are out of "
            "the target's range, and the drafter learns from them. Re-extract the cache to leave them out: "
            "dflash-extract holds samples to the target's positions (--long-samples truncate or skip).")


@renders("train.cache-being-written", example=dict(cache="cache", parts=12))
def _cache_being_written(cache, parts):
    return (f"The cache at {cache} is being written by a live extraction: this run trains on the {parts} parts "
            "committed when it started. `dflash-train --follow` trains on a cache while it is written; a later "
            "resume of this run on the grown cache is refused.")


@renders("train.cache-unfinished", example=dict(cache="cache", committed=6, planned=46, committed_samples=24,
                                                planned_samples=300, more=0, writer="dflash-extract"))
def _cache_unfinished(cache, committed, planned, committed_samples, planned_samples, more, writer):
    samples = f" ({committed_samples:,} of {planned_samples:,} samples)" if planned_samples else ""
    others = f" (and {more} more cache(s) like it)" if more else ""
    return (f"{cache} is not a finished cache: {committed} of its {planned} planned parts are committed{samples}"
            f"{others}. Its {writer} was stopped before its end, is still running, or lost one of its ranks. Rerun "
            f"the same {writer} command to finish it (it resumes from the committed parts), or train while it "
            "extracts with --follow; to train on the committed parts alone, pass --allow-incomplete.")


@renders("train.eval-cache-same-data", example=dict(eval_cache="held", cache="cache", digest="3f2a9c01b7d4"))
def _eval_cache_same_data(eval_cache, cache, digest):
    return (f"--eval-cache {eval_cache} holds the samples of --cache {cache}: both were extracted from the same data "
            f"(sha256 {digest[:12]}), so the held-out evaluation would measure samples the drafter trains on. "
            + _ELSEWHERE)


@renders("train.cache-given-twice", example=dict(flag="--cache", cache="a", other="./a"))
def _cache_given_twice(flag, cache, other):
    return (f"{flag} {cache} is given twice ({other}): each of its samples would be trained on twice an epoch. "
            "Give each cache once.")


@renders("train.eval-cache-is-cache", example=dict(eval_cache="a", cache="./a"))
def _eval_cache_is_cache(eval_cache, cache):
    return (f"--eval-cache {eval_cache} is also a --cache ({cache}): the held-out evaluation would measure samples "
            "the drafter trains on. " + _ELSEWHERE)


@renders("train.no-training-samples", example=dict(caches=["cache"], samples=10, eval_fraction=1.0))
def _no_training_samples(caches, samples, eval_fraction):
    return (f"No training samples: the caches {caches} hold {samples} samples and --eval-fraction {eval_fraction} "
            "holds out all of them.")


@renders("train.shuffle-parts-negative", example=dict(value=-1))
def _shuffle_parts_negative(value):
    return f"--shuffle-parts must be 0 (shuffle the whole data) or more (got {value})."


@renders("train.follow-several-caches", example=dict(caches=2))
def _follow_several_caches(caches):
    return (f"--follow follows one cache, but {caches} were given with --cache: follow one, or train on finished "
            "caches without --follow.")


@renders("train.follow-remote", example=dict(cache="s3://bucket/cache"))
def _follow_remote(cache):
    return (f"--follow reads a local cache while dflash-extract writes it; {cache} is a remote URL, which no "
            "extraction writes: train on it without --follow once it is uploaded, or follow the local cache the "
            "extraction writes.")


@renders("train.follow-extraction-budget", example=dict(
    cache="cache", budget=200 * 2**30, file=".disk-budget",
    refusal="--shuffle-parts 0 under --disk-budget reads every part of an epoch at random: needs --shuffle-parts N."))
def _follow_extraction_budget(cache, budget, file, refusal):
    return (f"The extraction of {cache} runs under --disk-budget {budget} ({file}), and this run follows it without "
            f"one: what that budget needs holds here too. {refusal}")


@renders("train.disk-budget-group", example=dict(
    budget=8 * 2**30, shuffle_parts=16, group_bytes=10 * 2**30, parts=16, tokens=2_000_000, bytes_per_token=5120.0,
    measured_parts=8, batch_bytes=2**30, needed=11 * 2**30, fits=10))
def _disk_budget_group(budget, shuffle_parts, group_bytes, parts, tokens, bytes_per_token, measured_parts,
                       batch_bytes, needed, fits):
    from dflash.cache_tools.staging import format_size

    how = (f"measured on {measured_parts} committed part(s)" if measured_parts
           else "the arrays' raw size: no part is committed yet")
    beside = f" and the {format_size(batch_bytes)} of parts one extraction batch spans" if batch_bytes else ""
    fix = f"raise --disk-budget to at least {format_size(needed)} here and in dflash-extract"
    fix = f"Lower --shuffle-parts to {fits}, or {fix}" if fits else fix[0].upper() + fix[1:]
    return (f"--disk-budget {format_size(budget)} cannot hold a group of --shuffle-parts {shuffle_parts} planned parts "
            f"(about {format_size(group_bytes)}: {parts} parts, {tokens:,} tokens at {bytes_per_token:,.0f} B/token, "
            f"{how}){beside}: the run reads a group's parts in shuffled order and reports a part trained only once the "
            "group is past it, so the extraction would wait for room while the trainer waits for the group's other "
            f"parts, for ever. {fix} (docs/train.md, \"A disk budget\").")


@renders("train.step-over-epoch", example=dict(micro_batches=16, world_size=8, grad_accum=2, epoch_batches=12))
def _step_over_epoch(micro_batches, world_size, grad_accum, epoch_batches):
    return (f"One optimizer step needs {micro_batches} micro-batches (world size {world_size} x --grad-accum "
            f"{grad_accum}) but an epoch has only {epoch_batches}: lower --token-budget, --max-batch-size or "
            "--grad-accum.")


@renders("train.loader-state-version", example=dict(version=None, current=1))
def _loader_state_version(version, current):
    return f"Loader state version {version} is not {current}."


@renders("train.resume-off-step-boundary", example=dict(batches=12, micro_batches=8))
def _resume_off_step_boundary(batches, micro_batches):
    return "The checkpoint's data position is not at a step boundary of this run."


@renders("train.samples-over-token-budget", example=dict(samples=3, token_budget=4096, longest=8192,
                                                         max_seq_len=8192))
def _samples_over_token_budget(samples, token_budget, longest, max_seq_len):
    return (f"{samples} sample(s) are longer than --token-budget {token_budget} (the longest has {longest} tokens "
            f"after truncation to --max-seq-len {max_seq_len}). Raise --token-budget to at least the longest sample, "
            "or lower --max-seq-len to truncate them.")


# -- the startup's caveats (TrainingData.caveats): lines of its summary -------------------------


@renders("train.no-heldout", example=dict())
def _no_heldout():
    return "no held-out samples: tau is measured on training batches (set --eval-fraction or --eval-cache)"


@renders("train.few-heldout", example=dict(samples=12))
def _few_heldout(samples):
    return f"only {samples} held-out samples evaluated: a noisy tau (raise --eval-fraction or give --eval-cache)"


@renders("train.few-heldout-groups", example=dict(held=16, eval_fraction=0.08, groups=64))
def _few_heldout_groups(held, eval_fraction, groups):
    return (f"warning: only {held} whole group(s) of the records are held out: a pooled tau over so few documents "
            "rests on which they are (docs/recipe.md, held-out split); raise --eval-fraction to about "
            f"{eval_fraction:g} (about {groups} groups; without top-k log-probs, --top1-share at least that) or give "
            "--eval-cache of greedy completions of other documents' prompts")


@renders("train.heldout-no-top1", example=dict(cache="cache"))
def _heldout_no_top1(cache):
    return ("warning: the held-out cache stores no target top-1 (--no-store-top1, or an older cache): its estimate "
            "checks drafts against the samples' own tokens and under-reads on sampled completions; extract without "
            "--no-store-top1, or give --eval-cache of greedy completions")


@renders("train.heldout-some-top1", example=dict(samples=40, evaluated=100, top1_share=[0.02]))
def _heldout_some_top1(samples, evaluated, top1_share):
    share = ", ".join(f"{s:g}" for s in top1_share)
    return (f"warning: {samples} of the {evaluated} evaluated held-out samples have no target top-1 (dflash-extract "
            f"--top1-share {share}): their estimate under-reads on sampled completions; extract with --top1-share at "
            "least --eval-fraction (1 for an --eval-cache), or lower --eval-fraction or --eval-max-samples")


@renders("train.few-training-samples", example=dict(samples=48))
def _few_training_samples(samples):
    return (f"only {samples} training samples: more target completions help most (dflash-generate "
            "--samples-per-prompt 3; docs/recipe.md)")


@renders("train.samples-truncated", example=dict(samples=3, max_seq_len=4096, tokens=1200))
def _samples_truncated(samples, max_seq_len, tokens):
    return f"{samples} sample(s) longer than --max-seq-len {max_seq_len} are truncated ({tokens} tokens dropped)"


@renders("train.chat-templates-differ", example=dict(templates=[["3f2a9c01b7d4", {"enable_thinking": False}],
                                                                ["3f2a9c01b7d4", {"enable_thinking": True}]]))
def _chat_templates_differ(templates):
    import json

    described = "; ".join(f"sha256 {sha} kwargs {json.dumps(kwargs)}" for sha, kwargs in templates)
    return (f"WARNING: the data was rendered with {len(templates)} different chat templates or kwargs ({described}): "
            "a drafter learns the rendering it trains on, so serve with the one that most of the data used, or "
            "prepare the data again with one")


# -- shared_memory.py ---------------------------------------------------------------------------------


@renders("train.shared-memory", example=dict(path="/dev/shm", free=64 * 2**20, batch_bytes=671 * 2**20, loaders=2,
                                              workers=4, prefetch=4, fit_workers=0, fit_prefetch=1))
def _shared_memory(path, free, batch_bytes, loaders, workers, prefetch, fit_workers, fit_prefetch):
    gib = 2**30
    now = (f"{fit_workers} worker(s) x --prefetch-factor {fit_prefetch}" if fit_workers else
           "no worker: the trainer's process reads the batches itself, more slowly")
    evaluation = " (twice that while a held-out evaluation reads)" if loaders > 1 else ""
    return (f"{path} has {free / gib:.2f} GiB free, and the loader's {workers} worker(s) x --prefetch-factor "
            f"{prefetch} batches of up to {batch_bytes / gib:.2f} GiB would wait there at once{evaluation}: a "
            f"worker that fills it dies partway through the run. This run keeps {now}. To read at full speed, give "
            f"the host more shared memory (`docker run --shm-size 32g`, or a larger tmpfs on {path}).")

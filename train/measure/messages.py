"""What dflash.train.measure tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import Finding, renders

# -- evaluation.py ----------------------------------------------------------------------------------


@renders("train.nothing-to-evaluate", example=dict(samples=12, eval_caches=["heldout-cache"]))
def _nothing_to_evaluate(samples, eval_caches):
    where = f"--eval-cache {', '.join(eval_caches)}" if eval_caches is not None else "the held-out split of --cache"
    return (f"Nothing to evaluate: none of the {samples} held-out samples ({where}) has a completion token a block "
            "could draft (a block starts at a loss-masked token and predicts the next: a sample needs 2 of them). A "
            "tau would read 1.0 and the loss 0 for any drafter. Give held-out samples with their full completions "
            "(check the data's loss_mask and --max-seq-len).")


# -- reporting.py: held-out samples unlike the training ones (unlike_heldout_finding) ------------------


def _measure(said_to_measure):
    return ("" if said_to_measure else ": measure the drafter with dflash-eval on prompts of other documents, or "
            "hold out more of them (a larger --eval-fraction)")


@renders("train.heldout-unlike-confidence", example=dict(held=0.850, training=0.804, samples=512, adjusted=7.22,
                                                         ahead=False, said_to_measure=False))
def _heldout_unlike_confidence(held, training, samples, adjusted, ahead, said_to_measure):
    high = held > training
    reads = ("will likely read " if ahead else "likely reads ") + ("high" if high else "low")
    corrected = (f"; corrected for that by the held-out samples' own tau against their confidence "
                 f"(tau_confidence_adjusted) it reads {adjusted:.3f}" if adjusted else "")
    return (f"The target is {'surer' if high else 'less sure'} of the held-out text than of the training text: its "
            f"mean top-1 probability is {held:.3f} over the held-out samples and {training:.3f} over {samples} "
            f"training samples ({100 * (held / training - 1):+.1f} %), so the held-out documents are likely "
            f"{'easier' if high else 'harder'} for the drafter too and its held-out tau {reads}{corrected} (on the "
            f"project's BPE code benchmark a split 5.7 % surer read 1.25x the decoded tau, and 1.02x so corrected)"
            f"{_measure(said_to_measure)}")


@renders("train.heldout-unlike-text", example=dict(held=2.31, training=2.0, samples=512, ahead=True,
                                                   said_to_measure=False))
def _heldout_unlike_text(held, training, samples, ahead, said_to_measure):
    ratio = held / training
    return (f"The held-out text repeats itself {'more' if ratio > 1 else 'less'} than the training text: prompt "
            f"lookup walks {held:.3f} along the held-out samples and {training:.3f} along {samples} training "
            f"samples ({100 * (ratio - 1):+.0f} %), so the held-out documents are unlike the rest and the held-out "
            f"tau {'may' if ahead else 'can'} read high or low (on the project's BPE code benchmark a split whose text "
            f"repeated itself 14 % less read 1.25x the decoded tau){_measure(said_to_measure)}")


# -- reporting.py: the held-out tau over a run ---------------------------------------------------------


def _not_improved(tau, best_tau, best_step, evaluations):
    return f"held-out tau {tau:.3f} has not improved on {best_tau:.3f} (step {best_step}) for {evaluations} evaluations"


def _keep(best_step):
    return f"final/ will be the step-{best_step} checkpoint, the best held-out one."


@renders("train.heldout-overfitting", example=dict(tau=2.1, best_tau=2.4, best_step=400, evaluations=2,
                                                   best_train_tau=2.6, train_tau=3.3, flag="--epochs"))
def _heldout_overfitting(tau, best_tau, best_step, evaluations, best_train_tau, train_tau, flag):
    return (f"{_not_improved(tau, best_tau, best_step, evaluations)} while training tau rose {best_train_tau:.3f} -> "
            f"{train_tau:.3f}: the drafter is fitting its training samples, not the target (overfitting). More data "
            f"helps most; fewer {flag} stop it earlier. {_keep(best_step)}")


@renders("train.heldout-stalled", example=dict(tau=2.1, best_tau=2.4, best_step=400, evaluations=2))
def _heldout_stalled(tau, best_tau, best_step, evaluations):
    return (f"{_not_improved(tau, best_tau, best_step, evaluations)}: it has stopped improving. More data or a larger "
            f"drafter may help. {_keep(best_step)}")


# -- estimate.py: dflash-train estimate ---------------------------------------------------------------


@renders("train.estimate-not-export", example=dict(dir="runs/x/checkpoints/step-10"))
def _estimate_not_export(dir):
    return (f"{dir} is not an exported drafter: it needs config.json and model.safetensors. Pass a directory "
            "written by `dflash-train export` or a run's RUN_DIR/final.")


@renders("train.estimate-load", example=dict(drafter="runs/x/final", target="/models/t",
                                             cause=Finding("train.export-no-num-target-layers")))
def _estimate_load(drafter, target, cause):
    return f"Cannot load the drafter {drafter} for the target {target}: {cause}"


@renders("train.estimate-layers", example=dict(drafter="runs/x/final", layers=[1, 2], cache="cache",
                                               cache_layers=[0, 3]))
def _estimate_layers(drafter, layers, cache, cache_layers):
    return (f"The drafter {drafter} reads target layers {layers} but the cache {cache} holds layers {cache_layers}. "
            f"Extract the cache with --target-layer-ids {','.join(map(str, layers))}.")


@renders("train.estimate-no-samples", example=dict(caches=["cache"]))
def _estimate_no_samples(caches):
    return f"The cache(s) {', '.join(caches)} hold no sample to evaluate."


# -- compare.py: dflash-compare -----------------------------------------------------------------------


@renders("train.compare-heads-unknown", example=dict(unknown=["eagle"], heads=["dflash", "dflash2"]))
def _compare_heads_unknown(unknown, heads):
    return f"--heads {','.join(unknown)}: no such head; the heads are {', '.join(heads)}."


@renders("train.compare-fraction", example=dict(fraction=1.5))
def _compare_fraction(fraction):
    return (f"--fraction must be above 0 and at most 1 (got {fraction}): the share of the training samples each "
            "candidate trains on, e.g. 0.25.")


@renders("train.compare-drafter-type", example=dict(drafter_type="dflash2"))
def _compare_drafter_type(drafter_type):
    return (f"dflash-compare chooses the head: drafter_type {drafter_type!r} (--drafter-type, or a key of --config) "
            "names one. Name the candidates with --heads and leave drafter_type out.")


@renders("train.compare-torchrun", example=dict(world_size=8))
def _compare_torchrun(world_size):
    return (f"dflash-compare trains its candidates one after another in one process (here WORLD_SIZE is "
            f"{world_size}): start it without torchrun. For several GPUs, run one compare per GPU (--heads HEAD "
            "--device cuda:N --no-train-best, the same --output-dir), then the whole command once more: it reads "
            "their results.")


@renders("train.compare-follow", example=dict(flag="--follow"))
def _compare_follow(flag):
    return (f"dflash-compare needs a finished cache: leave out {flag} (its candidates would each train on a "
            "different part of a growing cache).")


@renders("train.compare-no-heldout", example={})
def _compare_no_heldout():
    return ("dflash-compare measures each head on held-out samples, and this run holds none out: pass "
            "--eval-fraction above 0 (e.g. 0.02) or an --eval-cache.")


@renders("train.compare-no-evaluation", example=dict(file="out/compare/dflash2/metrics.jsonl",
                                                     run_dir="out/compare/dflash2"))
def _compare_no_evaluation(file, run_dir):
    return (f"{file} holds no held-out evaluation of the candidate: rerun the same command to train and evaluate "
            f"it again (or delete {run_dir} to start it over).")


@renders("train.compare-not-lossless", example=dict(heads=["dspark"]))
def _compare_not_lossless(heads):
    return (f"A decoded output of {', '.join(heads)} differs from the target's greedy output (docs/eval.md, 'The "
            "lossless check').")


# -- loader_watch.py -----------------------------------------------------------------------------------


@renders("train.loader-bound", example=dict(step=20, data_wait=0.35, workers=2, threads=4, cores=16))
def _loader_bound(step, data_wait, workers, threads, cores):
    busy = workers * threads
    more = (f"raise --num-workers (this process may use {cores} cores, its {workers} worker(s) decode on {busy})"
            if busy < cores - 1 else
            f"give the process more cores (its {workers} worker(s) decode on {busy} of its {cores})")
    return (f"The GPU waited for batches {data_wait:.0%} of the time in the steps before {step}: the loader's {workers} "
            f"worker(s) read the cache more slowly than the drafter trains on it (long samples bring more states a "
            f"step). To train at the GPU's speed, {more}, or train from an fp8 cache, which reads faster "
            "(`dflash-cache recompress CACHE CACHE-fp8 --codec fp8`; docs/train.md, 'Long samples').")

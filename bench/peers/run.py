"""The peers side by side: SpecForge's and ModelOpt's DFlash drafters trained on the quality
benchmark's data and target, every export decoded by dflash-eval (lossless check and prompt
lookup beside it), one table row per run.

Reads a work directory that `bench/quality/device.sh prep` (or run.py's target, generate and
extract stages) made: target/, cache/, eval_prompts.jsonl, settings.json. Writes WORKDIR/peers/.

Runs (each resumable: a stage recorded in WORKDIR/peers/RUN/<stage>.json is skipped):

  specforge-same   SpecForge offline DFlash from our cache (as .ckpt files): our target layers,
                   draft layers, block size, mask token, epochs, lr, warmup, clip, anchors, gamma
  specforge-own    SpecForge's Qwen3-8B DFlash recipe (configs/qwen3-8b-dflash.json, 5 draft layers,
                   target layers by its rule; batch 4 of 3072 tokens (as sequences of the cache's
                   length: the same tokens a step), 6 epochs, lr 6e-4, warmup 0.04, gamma 7)
  modelopt-same    ModelOpt's DFlash (HF Trainer on the in-process target) at our settings; it
                   needs one target layer per draft layer, so its draft has len(target_layer_ids) layers;
                   its logit distillation where ours trains on the cache's soft labels (SpecForge's
                   offline trainer has none: its differs.json says so)
  modelopt-own     ModelOpt 0.47.0's modelopt_recipes/general/speculative_decoding/dflash.yaml:
                   block 8, 5 draft layers (target layers by its rule) of the target's attention and
                   MLP sizes, 10 epochs, lr 6e-4, 100 warmup steps, linear decay, logit distillation
                   on, D-PACE weights

    python bench/peers/run.py --workdir W prep
    python bench/peers/run.py --workdir W train specforge-same modelopt-same
    python bench/peers/run.py --workdir W eval specforge-same modelopt-same
    python bench/peers/run.py --workdir W table

The peers' packages are imported only by their own processes (specforge's CLI, modelopt_train.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "quality"))

from convert import PeerBenchError, cache_to_ckpt_dir, normalize_export  # noqa: E402

RUNS = ("specforge-same", "specforge-own", "modelopt-same", "modelopt-own")
TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `name` in a flag list (the last one wins, as click reads them)."""
    value = default
    for a, b in zip(args, args[1:]):
        if a == name:
            value = b
    return value


@dataclass(kw_only=True)
class Ours:
    """The settings our drafter trains with on this work directory (what "same" means)."""

    target_layer_ids: list[int]
    num_draft_layers: int = 5
    block_size: int = 16
    mask_token_id: int
    epochs: int = 10
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    max_anchors: int = 512
    token_budget: int = 16384
    max_batch_size: int = 64
    seed: int = 0
    dtype: str = "bf16"
    max_seq_len: int = 0
    """Longest sample of the cache (the peers' max length)."""
    mean_seq_len: float = 0.0
    samples: int = 0
    """Samples in the cache."""
    soft_labels: bool = False
    """Ours trains on the target's soft labels (dflash-train's default where the cache stores them)."""

    @property
    def gamma(self) -> float:
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, 7.0)

    @property
    def batch_samples(self) -> int:
        """Samples per optimizer step that match our padded-token budget per micro-batch."""
        return max(1, min(self.max_batch_size, self.token_budget // max(1, self.max_seq_len)))


SHARDINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")


@dataclass
class Work:
    root: Path
    device: str = "cuda"
    log: Any = print
    eval_batch: int | None = None
    """Prompts dflash-eval decodes at once (None: settings.json's eval_batch, else 1)."""
    specforge_sharding: str = "NO_SHARD"
    """SpecForge's training.fsdp_sharding: NO_SHARD wraps the draft in DDP, the others in FSDP."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peers(self) -> Path:
        return self.root / "peers"

    def run_dir(self, run: str) -> Path:
        return self.peers / run

    def done(self, run: str, stage: str) -> dict[str, Any] | None:
        path = self.run_dir(run) / f"{stage}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def record(self, run: str, stage: str, result: dict[str, Any]) -> dict[str, Any]:
        path = self.run_dir(run) / f"{stage}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
        return result


def benchmark_mask_token_id(root: Path) -> int:
    """The mask token the benchmark trained its drafters with: MASK_TOKEN_ID when set, else the
    target stage's record (stages/target.json), else the target's tokenizer (its mask token), else
    the byte vocabulary's (bench/quality/corpus.py), for work directories older than the record."""
    if os.environ.get("MASK_TOKEN_ID"):
        return int(os.environ["MASK_TOKEN_ID"])
    stage = root / "stages" / "target.json"
    if stage.is_file():
        recorded = json.loads(stage.read_text()).get("mask_token_id")
        if recorded is not None:
            return int(recorded)
    tokenizer_id = tokenizer_mask_token_id(root / "target")
    if tokenizer_id is not None:
        return tokenizer_id
    import corpus  # bench/quality: the byte vocabulary's ids

    return int(corpus.MASK_ID)


def tokenizer_mask_token_id(target: Path) -> int | None:
    """The id of the mask token that the tokenizer files in `target` name, or None."""
    config_path, tokenizer_path = target / "tokenizer_config.json", target / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        return None
    mask = json.loads(config_path.read_text()).get("mask_token")
    if isinstance(mask, dict):  # an AddedToken's serialized form
        mask = mask.get("content")
    if not mask:
        return None
    tokenizer = json.loads(tokenizer_path.read_text())
    for added in tokenizer.get("added_tokens") or []:
        if added.get("content") == mask:
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return int(vocab[mask]) if isinstance(vocab, dict) and mask in vocab else None


def write_config(path: Path, text: str) -> None:
    """Write `text` to `path` unless it holds it already, through a unique temporary name and a
    rename: device.sh's jobs run side by side and each runs prep, while another one's peer may be
    reading the file."""
    if path.is_file() and path.read_text() == text:
        return
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def our_settings(work: Work, epochs: int | None) -> Ours:
    """Our drafter's settings on this work directory: the benchmark's sizes and train_args on top
    of dflash-train's defaults, the mask token the benchmark passes, the cache's lengths."""
    settings_path = work.root / "settings.json"
    if not settings_path.is_file() or not (work.root / "cache" / "manifest.json").is_file():
        raise PeerBenchError(f"{work.root} holds no prepared quality benchmark (settings.json, cache/); run "
                             "`bash bench/quality/device.sh prep` with WORKDIR set to it first.")
    s = json.loads(settings_path.read_text())
    args = list(s.get("train_args") or [])
    from dflash.cache_tools.manifest import read_manifest

    manifest = read_manifest(work.root / "cache")
    lengths = [n for p in manifest.parts for n in p.lengths]
    dtype = _flag(args, "--dtype", "bf16") or "bf16"
    from dflash.train.config import DEFAULT_SOFT_LABEL_WEIGHT, OptimizationConfig

    weight = float(_flag(args, "--soft-label-weight", str(DEFAULT_SOFT_LABEL_WEIGHT)))
    return Ours(soft_labels=weight > 0 and bool(manifest.topk or manifest.store_last_hidden),target_layer_ids=manifest.target_layer_ids,
                num_draft_layers=int(_flag(args, "--num-draft-layers", "5")),
                block_size=int(_flag(args, "--block-size", "16")),
                mask_token_id=benchmark_mask_token_id(work.root),
                epochs=epochs or OptimizationConfig.epochs, lr=float(_flag(args, "--lr", "6e-4")),
                max_anchors=int(_flag(args, "--max-anchors", "512")),
                token_budget=int(_flag(args, "--token-budget", "16384")),
                max_batch_size=int(_flag(args, "--max-batch-size", "64")), seed=int(s.get("seed", 0)),
                dtype="fp32" if work.device == "cpu" else dtype,
                max_seq_len=max(lengths), mean_seq_len=sum(lengths) / len(lengths), samples=len(lengths))


# -- prep: the data and the configs -------------------------------------------------------------


def peer_target(work: Work) -> Path:
    """The target as the peers load it: its files, plus a tokenizer when it has none.

    SpecForge and ModelOpt load the target's tokenizer with AutoTokenizer even when training
    from token ids; a byte-level target has none, so a word-level tokenizer over its ids is
    written (`"<id>"` -> id): it is used only for the pad id, which is given explicitly.
    """
    src, out = work.root / "target", work.peers / "target"
    out.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES + TOKENIZER_FILES:
        if (src / name).is_file() and not (out / name).exists():
            try:
                (out / name).symlink_to((src / name).resolve())
            except FileExistsError:  # a prep beside this one made it
                pass
    if not (out / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        config = json.loads((src / "config.json").read_text())
        vocab = {str(i): i for i in range(int(config["vocab_size"]))}
        tok = Tokenizer(WordLevel(vocab, unk_token="0"))
        tok.pre_tokenizer = WhitespaceSplit()
        write_config(out / "tokenizer.json", tok.to_str())
        pad = config.get("pad_token_id")
        write_config(out / "tokenizer_config.json", json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
            **({"pad_token": str(pad)} if pad is not None else {})}) + "\n")
    return out


def draft_config(work: Work, ours: Ours, *, layers: int, target_layer_ids: list[int] | None,
                 block_size: int) -> dict[str, Any]:
    """A DFlashDraftModel config.json at the target's dimensions (SpecForge's draft_model_config)."""
    t = json.loads((work.root / "target" / "config.json").read_text())
    dflash: dict[str, Any] = {"mask_token_id": ours.mask_token_id}
    if target_layer_ids is not None:  # else SpecForge picks them by its rule
        dflash["target_layer_ids"] = list(target_layer_ids)
    rope = t.get("rope_parameters") or {}
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "num_target_layers": t["num_hidden_layers"], "num_hidden_layers": layers, "dflash_config": dflash,
        "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": t.get("rope_theta", rope.get("rope_theta", 1e6)),
        "rope_scaling": None, "max_position_embeddings": t.get("max_position_embeddings", 40960),
        "vocab_size": t["vocab_size"], "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "layer_types": ["full_attention"] * layers, "initializer_range": 0.02,
        "dtype": "bfloat16",
    }


def peer_layer_rule(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's and ModelOpt's default target layers: one per draft layer, spread over
    1..N-3 (both packages' rule, which agree for N >= 4)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    span = max(start, num_target_layers - 3) - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def own_layer_ids(num_target_layers: int, num_draft_layers: int, ours: Ours) -> tuple[list[int] | None, str]:
    """(explicit target layers or None for the peer's own rule, a note): the rule repeats a layer
    on a shallow target (6 layers, 5 draft layers: [1, 2, 2, 2, 3]), which no engine serves; ours then."""
    rule = peer_layer_rule(num_target_layers, num_draft_layers)
    if len(set(rule)) == len(rule) and rule == sorted(rule):
        return None, f"target layers {rule} by the peer's rule"
    return list(ours.target_layer_ids), (f"target layers ours {list(ours.target_layer_ids)}: the peer's rule gives "
                                         f"{rule} on this {num_target_layers}-layer target, repeated layers no engine serves")


def specforge_config(work: Work, ours: Ours, own: bool) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(run.yaml as a dict, the draft config, the settings that differ from ours)."""
    cpu = work.device == "cpu"
    t = json.loads((work.root / "target" / "config.json").read_text())
    run = work.run_dir("specforge-own" if own else "specforge-same")
    if own:  # configs/qwen3-8b-dflash.json + examples/configs/.../qwen3-8b-dflash*.yaml
        # Its recipe is batch 4 of max_length 3072 tokens: the same tokens per step as sequences of
        # our length (4 of ours would be ~12x the steps of its recipe on the same tokens).
        batch = max(1, 4 * 3072 // max(1, ours.max_seq_len))
        layers, block, epochs = 5, 16, 6
        layer_ids, note = own_layer_ids(t["num_hidden_layers"], 5, ours)
        differs = [f"draft layers 5, {note}", "block 16", "epochs 6",
                   f"batch {batch} sequences (its 4 of 3072 tokens a step)", "gamma 7"]
    else:
        layers, layer_ids, block, epochs, batch = (ours.num_draft_layers, ours.target_layer_ids, ours.block_size,
                                                   ours.epochs, ours.batch_samples)
        differs = [f"batch {batch} sequences (ours: a budget of {ours.token_budget} padded tokens)",
                   "loss weights exp(-(k-1)/gamma) (ours: acceptance)"]
        if ours.soft_labels:
            differs.append("no soft labels (its offline trainer has none; ours: KL to the cached top-k, weight 0.5)")
    draft = draft_config(work, ours, layers=layers, target_layer_ids=layer_ids, block_size=block)
    if work.specforge_sharding == "NO_SHARD":
        differs.append("one process under DDP (fsdp_sharding NO_SHARD; its default FSDP SHARD_GRAD_OP makes the "
                       "same update on one rank and has no CPU path)")
    # The draft's weights are bf16 (fp32 masters in SpecForge's optimizer) on the CPU too: the
    # .ckpt hidden states are bf16, and only FSDP's mixed precision would cast fp32 weights to them.
    config = {
        "model": {"target_model_path": str(peer_target(work)), "draft_model_config": str(run / "draft.json"),
                  "mask_token_id": ours.mask_token_id, "tokenizer_pad_token_id": int(t.get("pad_token_id") or 0),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(work.peers / "ckpt"), "max_length": max(ours.max_seq_len, 16),
                 "dataloader_num_workers": 0 if cpu else 4},
        "training": {"strategy": "dflash", "num_epochs": epochs, "batch_size": batch,
                     "fsdp_sharding": work.specforge_sharding,
                     "learning_rate": 6e-4 if own else ours.lr, "warmup_ratio": 0.04 if own else ours.warmup_ratio,
                     "max_grad_norm": 1.0 if own else ours.grad_clip, "lr_scheduler": "cosine",
                     "attention_backend": "sdpa" if cpu else "flex_attention", "num_anchors": 512 if own else ours.max_anchors,
                     "loss_decay_gamma": 7.0 if own else ours.gamma, "save_interval": 0,
                     "log_interval": max(1, min(20, epochs * (ours.samples // batch) // 5)),
                     "seed": 42 if own else ours.seed},
        "tracking": {"report_to": "none"},
        "run_id": run.name, "output_dir": str(run / "output"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    if cpu:
        differs.append("CPU smoke: sdpa (flex_attention has no backward on a CPU)")
    return config, draft, differs


def target_dims(work: Work) -> dict[str, Any]:
    """The target's attention and MLP sizes, which our drafter takes (ModelOpt must be given them:
    its draft config is a Qwen3Config whose defaults win over the target's)."""
    t = json.loads((work.root / "target" / "config.json").read_text())
    return {"num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
            "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
            "intermediate_size": t["intermediate_size"]}


def modelopt_config(work: Work, ours: Ours, own: bool) -> tuple[dict[str, Any], list[str]]:
    """The recipe modelopt_train.py runs: the DFlashConfig dict (`dflash`) and HF TrainingArguments
    (`training`), and the settings that differ from ours."""
    cpu = work.device == "cpu"
    if own:  # modelopt_recipes/general/speculative_decoding/dflash.yaml (0.47.0)
        t = json.loads((work.root / "target" / "config.json").read_text())
        layer_ids, note = own_layer_ids(t["num_hidden_layers"], 5, ours)
        # ModelOpt means its draft to take the target's attention and MLP sizes where the recipe names
        # none (hf_dflash.py's setdefault over the base config), but 0.47's Qwen3Config defaults
        # (32 heads, MLP 22016) always win, which on this target makes a draft ten times its size:
        # the sizes are given here, as its code intends
        dims = target_dims(work)
        arch: dict[str, Any] = {"num_hidden_layers": 5, **dims}
        if layer_ids is not None:  # one target layer per draft layer: ModelOpt's draft shrinks to them
            arch = {"num_hidden_layers": len(layer_ids), "target_layer_ids": layer_ids, **dims}
            note = f"draft layers {len(layer_ids)}, {note}"
        else:
            note = f"draft layers 5, {note}"
        dflash = {"dflash_block_size": 8, "dflash_num_anchors": 512, "dflash_self_logit_distillation": True,
                  "dflash_loss_decay_factor": 4.0, "dflash_architecture_config": arch}
        # Its recipe is per_device_train_batch_size 1 of training_seq_len 4096 tokens: the same
        # tokens per step as sequences of our length.
        batch = max(1, 4096 // max(1, ours.max_seq_len))
        training = {"num_train_epochs": 10, "per_device_train_batch_size": batch, "learning_rate": 6e-4,
                    "warmup_steps": 100, "lr_scheduler_type": "linear", "weight_decay": 0.0}
        differs = ["block 8", note, "epochs 10",
                   "draft attention and MLP sizes the target's, given explicitly (ModelOpt 0.47 means to inherit "
                   "them, but its Qwen3Config defaults, 32 heads of 128 and MLP 22016, win over them)",
                   f"batch {batch} sequences (its 4096 tokens a step)", "logit distillation", "D-PACE weights",
                   "linear lr, 100 warmup steps"]
    else:
        dflash = {"dflash_block_size": ours.block_size, "dflash_num_anchors": ours.max_anchors,
                  # its logit distillation where ours trains on soft labels (the target in its loop gives them)
                  "dflash_self_logit_distillation": ours.soft_labels, "dflash_loss_objective": "decay",
                  "dflash_loss_decay_factor": ours.gamma,
                  "dflash_architecture_config": {"num_hidden_layers": len(ours.target_layer_ids),
                                                 "target_layer_ids": list(ours.target_layer_ids), **target_dims(work)}}
        training = {"num_train_epochs": ours.epochs, "per_device_train_batch_size": ours.batch_samples,
                    "learning_rate": ours.lr, "warmup_steps": ours.warmup_ratio, "lr_scheduler_type": "cosine",
                    "max_grad_norm": ours.grad_clip, "weight_decay": 0.0}
        differs = [f"draft layers {len(ours.target_layer_ids)} (ModelOpt needs one target layer per draft layer; "
                   f"ours: {ours.num_draft_layers})",
                   f"batch {ours.batch_samples} sequences (ours: a budget of {ours.token_budget} padded tokens)",
                   "loss weights exp(-(k-1)/gamma) (ours: acceptance)", "the target runs in the loop (no cache)",
                   "draft attention and MLP sizes given explicitly (the target's)"]
        if ours.num_draft_layers == len(ours.target_layer_ids):
            differs.pop(0)
    dflash.update(dflash_mask_token_id=ours.mask_token_id, dflash_use_torch_compile=False)
    training.update(seed=ours.seed, bf16=not cpu, logging_steps=20, save_strategy="no", report_to="none",
                    remove_unused_columns=False, dataloader_drop_last=True, disable_tqdm=True,
                    use_cpu=cpu)
    if cpu:
        differs.append("CPU smoke: fp32")
    return {"target": str(peer_target(work)), "cache": str(work.root / "cache"), "dflash": dflash,
            "training": training, "output_dir": str(work.run_dir("modelopt-own" if own else "modelopt-same"))}, differs


def prep(work: Work, ours: Ours) -> None:
    if not (work.peers / "ckpt.json").is_file():
        start = time.perf_counter()
        info = cache_to_ckpt_dir(work.root / "cache", work.peers / "ckpt")
        info["seconds"] = time.perf_counter() - start
        write_config(work.peers / "ckpt.json", json.dumps(info, indent=2) + "\n")
        work.log(f"[prep] {info['samples']} samples as .ckpt files ({info['skipped']} skipped), {info['seconds']:.0f} s")
    for run in RUNS:
        d = work.run_dir(run)
        d.mkdir(parents=True, exist_ok=True)
        own = run.endswith("-own")
        if run.startswith("specforge"):
            config, draft, differs = specforge_config(work, ours, own)
            write_config(d / "draft.json", json.dumps(draft, indent=2) + "\n")
            import yaml

            write_config(d / "run.yaml", yaml.safe_dump(config, sort_keys=False))
        else:
            config, differs = modelopt_config(work, ours, own)
            write_config(d / "recipe.json", json.dumps(config, indent=2) + "\n")
        write_config(d / "differs.json", json.dumps(differs, indent=2) + "\n")
    write_config(work.peers / "ours.json", json.dumps(asdict(ours), indent=2) + "\n")
    work.log(f"[prep] configs for {', '.join(RUNS)} in {work.peers}")


# -- train, export, eval ---------------------------------------------------------------------------


def _run(command: list[str], log_path: Path, stdout: Path | None = None, env: dict[str, str] | None = None) -> float:
    """Run `command` (output to log_path, stdout to `stdout` when given, `env` on top of ours);
    wall seconds."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        out = open(stdout, "w") if stdout else log
        try:
            done = subprocess.run(command, stdout=out, stderr=log,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        finally:
            if stdout:
                out.close()
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise PeerBenchError(f"{command[2] if len(command) > 2 else command[0]} failed with status {done.returncode} "
                             f"(full log in {log_path}):\n{tail}")
    return time.perf_counter() - start


SPECFORGE_LAYER_IDS = """
import sys, json
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
print(json.dumps(list(AutoDraftModel.from_config(AutoDraftModelConfig.from_file(sys.argv[1])).target_layer_ids)))
"""
"""The target layers SpecForge's draft reads (its own rule when draft.json names none)."""

SPECFORGE_STEP = re.compile(r"^step (\d+): \{.*'loss': ([^,}]+)", re.MULTILINE)
"""A logged line of SpecForge's trainer: `step N: {'acc': ..., 'loss': ..., ...}`."""


def specforge_steps(log_text: str) -> dict[str, Any]:
    """The steps and losses SpecForge's trainer logged (every log_interval steps)."""
    steps = [(int(n), float(loss)) for n, loss in SPECFORGE_STEP.findall(log_text)]
    if not steps:
        return {"logged_steps": 0}
    return {"logged_steps": len(steps), "last_step": steps[-1][0], "first_loss": steps[0][1],
            "last_loss": steps[-1][1]}


def train(work: Work, run: str) -> dict[str, Any]:
    d = work.run_dir(run)
    if not (d / "differs.json").is_file():
        raise PeerBenchError(f"{d} has no configs; run the prep step first.")
    logged: dict[str, Any] = {}
    if run.startswith("specforge"):
        # One process: SpecForge's CLI sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
        # MASTER_PORT itself and trains in this process (no torchrun), on the GPU with NCCL and
        # on a CPU with gloo. A fresh output directory: its export reads the newest checkpoint.
        shutil.rmtree(d / "output", ignore_errors=True)
        # SPECFORGE_DEVICE: the device asked for, not the one it finds (a CPU smoke on a GPU host)
        seconds = _run([sys.executable, "-m", "specforge.cli", "train", "-c", str(d / "run.yaml")], d / "train.log",
                       env={"SPECFORGE_DEVICE": "cpu" if work.device == "cpu" else "cuda"})
        logged = specforge_steps((d / "train.log").read_text())
        if not logged["logged_steps"]:
            raise PeerBenchError(f"SpecForge's trainer exited without logging a step (log in {d / 'train.log'}).")
        _run([sys.executable, "-c", SPECFORGE_LAYER_IDS, str(d / "draft.json")], d / "layers.log", stdout=d / "layers.json")
        export_seconds = _run([sys.executable, "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint",
                               str(d / "output"), "--draft-config", str(d / "draft.json"), "--output-dir",
                               str(d / "export")], d / "export.log")
    else:
        seconds = _run([sys.executable, str(HERE / "modelopt_train.py"), str(d / "recipe.json")], d / "train.log")
        export_seconds = 0.0  # modelopt_train.py exports in the same process (its time is in seconds)
    return {"run": run, "seconds": seconds, "export_seconds": export_seconds, **logged}


def load_as_is(export: Path, target: Path) -> str | None:
    """None when our loader takes the export as it is, else why not."""
    from dflash.train.exports.export import load_drafter

    try:
        load_drafter(export, target)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def eval_batch_size(work: Work) -> int:
    """Prompts dflash-eval decodes at once: --eval-batch, else the benchmark's eval_batch, else 1
    (batched decoding gives the same tokens and is much faster on a GPU)."""
    if work.eval_batch:
        return work.eval_batch
    s = json.loads((work.root / "settings.json").read_text())
    return int(s.get("eval_batch") or 1)


def evaluate(work: Work, run: str, ours: Ours) -> dict[str, Any]:
    d, target = work.run_dir(run), work.root / "target"
    s = json.loads((work.root / "settings.json").read_text())
    export = d / "export"
    exported = json.loads((export / "config.json").read_text())
    refusal = load_as_is(export, target)
    notes: list[str] = []
    drafter = export
    if refusal is not None:
        block = int(exported.get("block_size") or (exported.get("dflash_config") or {}).get("block_size"))
        layer_ids = (exported.get("dflash_config") or {}).get("target_layer_ids") or exported.get("target_layer_ids")
        if layer_ids is None and (d / "layers.json").is_file():  # what the peer's draft read
            layer_ids = json.loads((d / "layers.json").read_text())
        t = json.loads((target / "config.json").read_text())
        drafter = d / "export-dflash"
        notes = normalize_export(export, drafter, block_size=block, mask_token_id=ours.mask_token_id,
                                 target_layer_ids=layer_ids, num_target_layers=int(t["num_hidden_layers"]))
        still = load_as_is(drafter, target)
        if still is not None:
            raise PeerBenchError(f"{run}: our loader refuses the export ({refusal}) and its conversion ({still}).")
        work.log(f"  [{run}] converted: {'; '.join(notes)}")
    block = int(json.loads((drafter / "config.json").read_text())["block_size"])
    out = d / f"eval-b{block}.json"
    seconds = _run([sys.executable, "-c", "import sys; sys.argv[0] = 'dflash-eval'; from dflash.eval.cli import main; main()",
                    "--target-model", str(target), "--drafter", str(drafter), "--prompts", str(work.root / "eval_prompts.jsonl"),
                    "--max-new-tokens", str(s["eval_new_tokens"]), "--ignore-eos", "--block-size", str(block),
                    "--batch-size", str(eval_batch_size(work)), "--device", work.device, "--dtype", "float32",
                    "--lookup-ngram", str(s["lookup_ngram"]), "--json"], d / f"eval-b{block}.log", stdout=out)
    report = json.loads(out.read_text())
    [r] = report["prompt_sets"]
    lookup = r["prompt_lookup"]
    return {"run": run, "block_size": block, "loaded_as_is": refusal is None, "refusal": refusal, "conversion": notes,
            "target_layer_ids": (json.loads((drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"]),
            "draft_layers": json.loads((drafter / "config.json").read_text())["num_hidden_layers"],
            "tau": r["tau"], "tau_per_prompt_mean": r["tau_per_prompt_mean"],
            "lossless": r["lossless"].get("identical"), "lookup_tau": lookup["tau"],
            "lookup_tau_per_prompt_mean": lookup["tau_per_prompt_mean"], "lookup_lossless": lookup["lossless"].get("identical"),
            "speedup": r["speedup"], "eval_batch": eval_batch_size(work), "seconds": seconds}


# -- table -----------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def our_row(work: Work, ours: Ours) -> list[str] | None:
    """Our drafter at the same epochs, when the quality benchmark decoded it (`main "EPOCHS"`)."""
    name = f"e{ours.epochs}"
    train_stage = work.root / "stages" / f"train-{name}.json"
    ev = work.root / f"eval-{name}-b{ours.block_size}.json"
    if not train_stage.is_file() or not ev.is_file():
        return None
    t = json.loads(train_stage.read_text())
    [r] = json.loads(ev.read_text())["prompt_sets"]
    lookup = r["prompt_lookup"]
    return [f"ours ({name})", str(ours.block_size), str(ours.num_draft_layers), str(ours.target_layer_ids),
            _fmt(r["tau"]), _fmt(r.get("tau_per_prompt_mean")), _fmt(lookup["tau"]), _fmt(lookup.get("tau_per_prompt_mean")),
            _fmt(r["tau"] / max(lookup["tau"], 1e-9)) + "x", _fmt(t["seconds"], ".0f"),
            "yes" if r["lossless"].get("identical") and lookup["lossless"].get("identical") else "NO", "as-is", "–"]


def table(work: Work, ours: Ours) -> str:
    head = ["run", "block", "draft layers", "target layers", "tau", "tau (per-prompt mean)", "lookup tau",
            "lookup tau (per-prompt mean)", "tau / lookup", "train s", "lossless", "export", "flags that differ"]
    rows = [r for r in [our_row(work, ours)] if r]
    for run in RUNS:
        t, e = work.done(run, "train"), work.done(run, "eval")
        if not e:
            continue
        differs = json.loads((work.run_dir(run) / "differs.json").read_text())
        rows.append([run, str(e["block_size"]), str(e["draft_layers"]), str(e["target_layer_ids"]), _fmt(e["tau"]),
                     _fmt(e["tau_per_prompt_mean"]), _fmt(e["lookup_tau"]), _fmt(e["lookup_tau_per_prompt_mean"]),
                     _fmt(e["tau"] / max(e["lookup_tau"], 1e-9)) + "x", _fmt((t or {}).get("seconds"), ".0f"),
                     "yes" if e["lossless"] and e["lookup_lossless"] else "NO",
                     "as-is" if e["loaded_as_is"] else "converted: " + "; ".join(e["conversion"]), "; ".join(differs)])
    lines = [f"peers on {work.root}: epochs {ours.epochs} (same), block {ours.block_size}, target layers "
             f"{ours.target_layer_ids}, mask token {ours.mask_token_id}; dflash-eval greedy at each drafter's block, "
             "pooled tau = tokens / verification cycles; train s: wall seconds of the peer's training command "
             "(its startup included)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="A prepared quality-benchmark work directory.")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (cpu: the smoke run's settings).")
    parser.add_argument("--epochs", type=int, default=None, help="Epochs of the same-settings runs [default: 6, ours].")
    parser.add_argument("--eval-batch", type=int, default=None,
                        help="Prompts dflash-eval decodes at once [default: settings.json's eval_batch, else 1].")
    parser.add_argument("--specforge-sharding", choices=SHARDINGS, default="NO_SHARD",
                        help="SpecForge's training.fsdp_sharding [default: NO_SHARD, DDP on one process].")
    parser.add_argument("step", choices=("prep", "train", "eval", "table"))
    parser.add_argument("runs", nargs="*", help=f"Runs for train/eval [default: all of {', '.join(RUNS)}].")
    args = parser.parse_args(argv)
    work = Work(Path(args.workdir), device=args.device, eval_batch=args.eval_batch,
                specforge_sharding=args.specforge_sharding)
    try:
        ours = our_settings(work, args.epochs)
        if args.step == "prep":
            prep(work, ours)
        elif args.step in ("train", "eval"):
            for run in args.runs or RUNS:
                if run not in RUNS:
                    raise PeerBenchError(f"unknown run {run!r}; the runs are {', '.join(RUNS)}.")
                if work.done(run, args.step) is not None:
                    work.log(f"[{args.step} {run}] done earlier (remove {work.run_dir(run) / (args.step + '.json')} to redo)")
                    continue
                work.log(f"[{args.step} {run}]")
                result = train(work, run) if args.step == "train" else evaluate(work, run, ours)
                work.record(run, args.step, result)
                trained = f"{result['seconds']:.0f} s" + (f", loss {result['first_loss']:.3f} -> {result['last_loss']:.3f} "
                                                          f"by step {result['last_step']}" if "last_loss" in result else "")
                work.log(f"[{args.step} {run}] " + (trained if args.step == "train" else
                         f"tau {result['tau']:.2f} (lookup {result['lookup_tau']:.2f}), lossless {result['lossless']}"))
        text = table(work, ours)
        (work.peers / "table.md").write_text(text + "\n")
        if args.step == "table":
            print(text)
    except PeerBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""TrainConfig is made of sections, each setting declared once: the components (loader,
objective, drafter) read their section, while flags, config keys and the settings a checkpoint
records stay flat."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

import pytest
from conftest import make_tiny_target
from dflash.runtime.settings import settings_of
from dflash.train.config import (
    CONFIG_KEYS,
    DrafterSettings,
    ModelConfig,
    TrainConfig,
    TrainConfigError,
)

# The flat settings of dflash-train: its flags (with dashes), its config-file keys and the keys of
# the "config" a checkpoint records. Renaming one breaks users' config files and the comparison a
# resumed run makes with its checkpoint.
FLAT_SETTINGS = {
    "cache", "target_model", "output_dir", "eval_cache", "eval_fraction", "eval_max_samples", "eval_max_batches",
    "max_train_samples", "token_budget", "max_batch_size", "max_seq_len", "shuffle_window", "shuffle_parts",
    "follow", "allow_incomplete", "disk_budget", "staging_dir", "num_workers", "prefetch_factor", "verify_checksums", "num_draft_layers", "block_size",
    "mask_token_id", "draft_layer_types", "draft_sliding_window", "draft_causal", "init_drafter", "attention_backend",
    "max_anchors", "loss_weighting", "gamma", "noise_type", "noise_start", "noise_end", "soft_label_weight", "hard_label", "logits_chunk_mib",
    "drafter_type", "selector_loss_weight", "selector_top_k", "selector_rank", "selector_stop_gradient",
    "conv_kernel_size", "conv_group_size", "lr", "lr_schedule", "decay_ratio", "min_lr_ratio", "warmup_ratio",
    "weight_decay", "adam_betas", "adam_eps", "grad_accum", "grad_clip", "epochs", "max_steps", "seed", "dtype",
    "compile", "compile_mode", "compile_dynamic", "gradient_checkpointing", "memory_check", "parallel", "device", "log_interval",
    "eval_interval", "profile_interval", "progress", "tensorboard", "save_interval", "keep_checkpoints", "resume",
    # the heads' own settings (train/heads/*: each head lists them in its setting_names)
    "markov_rank", "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size", "markov_loss_weight",
    "markov_tv_weight", "confidence_loss_weight",
    "xpress_rank", "xpress_mlp_hidden", "xpress_topc", "xpress_passes", "xpress_consistency_passes",
    "xpress_consistency_weight", "xpress_base_anchor_weight",
    "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_mlp_ratio",
    "lilicorr_factor_dim", "lilicorr_logit_scale", "lilicorr_vector_eps", "lilicorr_loss_weight",
}
REQUIRED = {"cache": ["c"], "target_model": "t", "output_dir": "o"}


def _config_classes() -> list[type]:
    """Every settings dataclass of the trainer: TrainConfig's sections and each module's *Config."""
    import dflash.train

    found: dict[str, type] = {}
    for module in pkgutil.walk_packages(dflash.train.__path__, "dflash.train."):
        if module.name == "dflash.train.cli":
            continue
        mod = importlib.import_module(module.name)
        for value in vars(mod).values():
            if (isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == mod.__name__
                    and value.__name__.endswith(("Config", "Settings"))):
                found[value.__qualname__] = value
    return list(found.values())


def test_no_setting_is_declared_in_two_config_dataclasses():
    classes = _config_classes()
    sections = {typing.get_type_hints(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig)}
    assert sections <= set(classes) and {"DrafterConfig", "ObjectiveConfig", "DataConfig"} <= {
        c.__name__ for c in classes}
    declared: dict[str, list[str]] = {}
    for cls in classes:
        for name in vars(cls).get("__annotations__", {}):
            declared.setdefault(name, []).append(cls.__name__)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1}
    assert not twice, f"declared in more than one config dataclass: {twice}"


def test_flags_config_keys_and_to_dict_stay_flat_and_come_back():
    assert set(CONFIG_KEYS) == FLAT_SETTINGS
    assert {s.flag for s in settings_of(TrainConfig).values()} == {f"--{n.replace('_', '-')}" for n in FLAT_SETTINGS}
    config = TrainConfig.from_dict({**REQUIRED, "lr": 3e-4, "adam_betas": [0.9, 0.95], "drafter_type": "dflash2",
                                    "max_anchors": 7, "shuffle_parts": 2, "dtype": "bf16", "resume": True})
    flat = config.to_dict()
    assert set(flat) == FLAT_SETTINGS and flat["adam_betas"] == [0.9, 0.95]
    assert (config.optimization.lr, config.model.drafter_type, config.objective.max_anchors,
            config.data.shuffle_parts, config.runtime.dtype, config.logging.resume) == (
        3e-4, "dflash2", 7, 2, "bf16", True)
    assert TrainConfig.from_dict(flat) == config
    with pytest.raises(TrainConfigError) as refused:
        TrainConfig.from_dict({**REQUIRED, "learning_rate": 1e-3})
    assert refused.value.fields["unknown"] == ["learning_rate"]


def test_the_drafter_takes_every_drafter_setting_of_the_model_section(tmp_path):
    from dflash.train.model.drafter_config import DrafterConfig
    from transformers import AutoConfig

    target = make_tiny_target(tmp_path / "target")
    model = ModelConfig(target_model=str(target), drafter_type="dflash2", block_size=8, mask_token_id=3,
                        attention_backend="sdpa", selector_top_k=4, selector_rank=8, conv_kernel_size=3,
                        conv_group_size=8, num_draft_layers=2, draft_layer_types="sliding,full",
                        draft_sliding_window=5, draft_causal=True)
    drafter = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target), **model.drafter_overrides())
    for f in dataclasses.fields(DrafterSettings):
        assert getattr(drafter, f.name) == getattr(model, f.name), f.name
    assert (drafter.num_hidden_layers, drafter.layer_types, drafter.sliding_window, drafter.causal) == (
        2, ["sliding_attention", "full_attention"], 5, True)


@pytest.mark.parametrize("values,code,fields", [
    ({"cache": []}, "train.setting-required", {"flag": "--cache"}),
    ({"target_model": ""}, "train.setting-required", {"flag": "--target-model"}),
    ({"output_dir": ""}, "train.setting-required", {"flag": "--output-dir"}),
    ({"noise_type": "laplace"}, "train.setting-choice", {"flag": "--noise-type", "value": "laplace"}),
    ({"gamma": 5.0}, "train.gamma-without-decay", {"gamma": 5.0, "loss_weighting": "acceptance"}),
    ({"max_anchors": 0}, "train.setting-range", {"flag": "--max-anchors", "value": 0, "allowed": "at least 1"}),
    ({"draft_layer_types": "sliding"}, "train.sliding-needs-window", {"value": "sliding"}),
    ({"decay_ratio": 0.99}, "train.decay-ratio", {"decay_ratio": 0.99}),
    ({"save_interval": -1}, "train.setting-range", {"flag": "--save-interval", "value": -1, "allowed": "0 or more"}),
    ({"selector_top_k": 0}, "train.setting-range", {"flag": "--selector-top-k", "value": 0}),  # a head's
    ({"xpress_topc": -1}, "train.setting-range", {"flag": "--xpress-topc", "value": -1, "default": 512}),
    ({"learning_rate": 1e-3}, "train.unknown-settings", {"unknown": ["learning_rate"]}),
])
def test_each_section_checks_its_settings_naming_the_flag(values, code, fields):
    with pytest.raises(TrainConfigError) as refused:
        TrainConfig.from_dict({**REQUIRED, **values})
    assert refused.value.code == code
    assert {k: refused.value.fields.get(k) for k in fields} == fields


@pytest.mark.parametrize("values,flag", [
    ({"lr": float("nan")}, "--lr"), ({"lr": float("inf")}, "--lr"), ({"weight_decay": float("nan")}, "--weight-decay"),
    ({"weight_decay": float("inf")}, "--weight-decay"), ({"adam_eps": float("nan")}, "--adam-eps"),
    ({"adam_betas": (float("nan"), 0.999)}, "--adam-betas"), ({"grad_clip": float("nan")}, "--grad-clip"),
    ({"noise_start": float("nan")}, "--noise-start"), ({"selector_loss_weight": float("inf")}, "--selector-loss-weight"),
    ({"loss_weighting": "decay", "gamma": float("nan")}, "--gamma"),
])
def test_a_nan_or_inf_float_setting_is_refused_naming_its_flag(values, flag):
    with pytest.raises(TrainConfigError) as refused:
        TrainConfig.from_dict({**REQUIRED, **values})
    assert refused.value.code == "train.setting-not-finite" and refused.value.fields["flag"] == flag

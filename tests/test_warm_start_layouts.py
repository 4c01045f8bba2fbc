"""--init-drafter reads a drafter in every layout train/exports/drafter_layouts.py registers: z-lab's / vLLM's
(a wrapper prefix, sharded, bf16), speculators' (`speculators_model_type`, its layer config's diff
against Qwen3Config, its layer ids counted with the embedding), SpecForge's and ModelOpt's exports.
The checkpoints are written here from those trainers' documented keys and tensor names. A warm start
loads the backbone bit for bit, starts the head at its init where it changes (another head, a block
of another shape), and refuses a drafter of another target or that reads other layers, naming the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import LAYERS
from dflash.runtime.errors import InputError
from safetensors.torch import save_file
from test_train_warm_start import built

D2 = {"selector_rank": 8, "selector_top_k": 4, "conv_group_size": 8}
"""A tiny DFlash2 head (the run's default drafter type)."""


def source(tiny_world, drafter_type: str, block_size: int, seed: int = 7, **settings):
    """A drafter of the tiny target whose weights are not any run's init (another seed)."""
    from dflash.train.model.drafter import DFlashDrafter

    torch.manual_seed(seed)
    return DFlashDrafter.from_target(str(tiny_world["target"]), target_layer_ids=list(LAYERS), num_hidden_layers=1,
                                     block_size=block_size, drafter_type=drafter_type, **settings)


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _qwen3_keys(c) -> dict:
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_parameters["rope_theta"]}


def _tensors(drafter, prefix: str = "", dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}


def write_zlab(out: Path, drafter, *, prefix: str = "", shards: int = 1, **dflash_extra) -> Path:
    """z-lab's release layout (as vLLM and SGLang load it), bf16; vLLM names the tensors `model.*`."""
    c = drafter.config
    out.mkdir(parents=True)
    dflash = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids), **dflash_extra}
    arch = "DFlashDraftModel"
    if c.drafter_type == "dflash2":
        arch = "DFlash2DraftModel"
        dflash.update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                      selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    config = {"architectures": [arch], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "model_type": "qwen3",
              "block_size": c.block_size, "dflash_config": dflash, "num_target_layers": c.num_target_layers,
              "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None, "layer_types": ["full_attention"],
              "sliding_window": None, "tie_word_embeddings": False, "dtype": "bfloat16", **_qwen3_keys(c)}
    (out / "config.json").write_text(json.dumps(config))
    _write_weights(out, _tensors(drafter, prefix), shards)
    return out


SPECULATORS_ARCH = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}


def write_speculators(out: Path, drafter, target: Path, **over) -> Path:
    """speculators 0.9's save_pretrained: its config.json (the draft layers' Qwen3Config as a diff
    against the defaults: rms_norm_eps 1e-6 is left out) and the tensors under the same names."""
    c = drafter.config
    kind = c.drafter_type
    out.mkdir(parents=True)
    layer = {"model_type": "qwen3", **_qwen3_keys(c)}
    config = {
        "speculators_model_type": kind, "architectures": [SPECULATORS_ARCH[kind]], "speculators_version": "0.9.0",
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
                               "verifier": {"name_or_path": str(target), "architectures": ["Qwen3ForCausalLM"]}},
        "transformer_layer_config": layer, "draft_vocab_size": c.vocab_size, "block_size": c.block_size,
        "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id, "sliding_window_non_causal": kind == "dflash2",
        "sample_from_anchor": False}
    if kind == "dflash2":
        config.update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                      selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    if kind == "dspark":
        config.update(markov_rank=c.markov_rank, markov_head_type="vanilla",
                      enable_confidence_head=c.enable_confidence_head,
                      confidence_head_with_markov=c.confidence_head_with_markov)
    for key, value in over.items():
        (layer if key in ("hidden_size", "vocab_size") else config)[key] = value
    (out / "config.json").write_text(json.dumps(config))
    _write_weights(out, _tensors(drafter, dtype=torch.float32))
    return out


def write_specforge_dspark(out: Path, drafter) -> Path:
    """SpecForge's DSpark export: DSparkDraftModel, the head's keys in dflash_config with its
    projector_type, and (an early checkpoint's) heads under `logit_head.`."""
    c = drafter.config
    out.mkdir(parents=True)
    dflash = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids), "projector_type": "dspark",
              "attention_mode": "gqa", "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
              "enable_confidence_head": c.enable_confidence_head, "confidence_head_alpha": 1.0,
              "confidence_head_with_markov": c.confidence_head_with_markov}
    config = {"architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
              "model_type": "qwen3", "block_size": c.block_size, "dflash_config": dflash,
              "num_target_layers": c.num_target_layers, "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
              "layer_types": ["full_attention"], "sliding_window": None, **_qwen3_keys(c)}
    (out / "config.json").write_text(json.dumps(config))
    tensors = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
               for k, v in _tensors(drafter).items()}
    _write_weights(out, tensors)
    return out


def write_modelopt(out: Path, drafter, *, dspark: bool = False) -> Path:
    """ModelOpt's export: z-lab's keys (no prefix, rotary buffers dropped); its DSpark adds
    projector_type, shift_label (always true), use_confidence_head and the heads' bare names."""
    c = drafter.config
    out.mkdir(parents=True)
    dflash = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)}
    if dspark:
        dflash.update(projector_type="dspark", shift_label=True, markov_rank=16, markov_head_type="vanilla",
                      use_confidence_head=True)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
              "dflash_config": dflash, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "initializer_range": 0.02,
              "attention_bias": False, "attention_dropout": 0.0, "rope_scaling": None, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "num_target_layers": c.num_target_layers,
              "layer_types": ["full_attention"] * c.num_hidden_layers, **_qwen3_keys(c)}
    (out / "config.json").write_text(json.dumps(config))
    _write_weights(out, _tensors(drafter))
    return out


def assert_started_from(warm, fresh, theirs, *, head_fresh: bool, stored=torch.bfloat16) -> None:
    """The backbone's tensors are the source's (bit for bit, as the checkpoint `stored` them); the
    head's are the fresh run's init where `head_fresh`, else the source's too."""
    own, init, src = warm.state_dict(), fresh.state_dict(), theirs.state_dict()
    head = warm.head
    backbone = [k for k in own if not head.owns_tensor(k) and k in src]
    assert backbone and all(torch.equal(own[k], src[k].to(stored).to(own[k].dtype)) for k in backbone)
    assert any(not torch.equal(own[k], init[k]) for k in backbone)  # not the run's random init
    mine = [k for k in own if head.owns_tensor(k)]
    for k in mine:
        expected = init[k] if head_fresh else src[k].to(stored).to(own[k].dtype)
        assert torch.equal(own[k], expected), k


def test_a_zlab_dflash_drafter_sharded_and_prefixed_starts_a_dflash2_run_at_another_block(tiny_world, tmp_path):
    theirs = source(tiny_world, "dflash", block_size=8)
    drafter_dir = write_zlab(tmp_path / "zlab", theirs, prefix="model.", shards=2)
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(drafter_dir), block_size=16, **D2)
    fresh, _ = built(tiny_world, tmp_path, block_size=16, **D2)
    assert warm.config.drafter_type == "dflash2" and warm.config.block_size == 16
    assert_started_from(warm, fresh, theirs, head_fresh=True)
    said = [n for n in notes if n.startswith("warm start")]
    assert len(said) == 1 and "block 8 -> 16" in said[0] and "a DFlash drafter" in said[0], notes


def test_a_zlab_checkpoint_carrying_the_targets_tensors_loads_without_them(tiny_world, tmp_path):
    theirs = source(tiny_world, "dflash", block_size=4)
    drafter_dir = write_zlab(tmp_path / "zlab", theirs)
    save_file({"embed_tokens.weight": torch.zeros(64, 32), "rotary_emb.inv_freq": torch.ones(8)},
              str(drafter_dir / "extra.safetensors"))
    # the single-file layout reads model.safetensors only; the index names every shard
    (drafter_dir / "model.safetensors").rename(drafter_dir / "model-00001-of-00002.safetensors")
    (drafter_dir / "extra.safetensors").rename(drafter_dir / "model-00002-of-00002.safetensors")
    names = {n: "model-00001-of-00002.safetensors" for n in theirs.state_dict()}
    names.update({"embed_tokens.weight": "model-00002-of-00002.safetensors",
                  "rotary_emb.inv_freq": "model-00002-of-00002.safetensors"})
    (drafter_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dflash")
    fresh, _ = built(tiny_world, tmp_path, drafter_type="dflash")
    assert_started_from(warm, fresh, theirs, head_fresh=False)
    assert any("embed_tokens.weight" in n and "not read" in n for n in notes), notes


@pytest.mark.parametrize("kind, settings, run", [
    ("dflash", {}, {"drafter_type": "dflash"}),
    ("dflash2", D2, D2),
    ("dspark", {"markov_rank": 16}, {"drafter_type": "dspark", "markov_rank": 16}),
])
def test_a_speculators_drafter_starts_a_run_of_its_head_at_another_block(tiny_world, tmp_path, kind, settings, run):
    theirs = source(tiny_world, kind, block_size=8, **settings)
    drafter_dir = write_speculators(tmp_path / "spec", theirs, tiny_world["target"])
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(drafter_dir), block_size=4, **run)
    fresh, _ = built(tiny_world, tmp_path, block_size=4, **run)
    assert_started_from(warm, fresh, theirs, head_fresh=False, stored=torch.float32)  # no tensor of these is the block's
    assert any("speculators' layout" in n and "block 8 -> 4" in n for n in notes), notes


def test_a_specforge_dspark_export_starts_a_dspark_run(tiny_world, tmp_path):
    run = {"drafter_type": "dspark", "markov_rank": 16}
    theirs = source(tiny_world, "dspark", block_size=4, markov_rank=16)
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(write_specforge_dspark(tmp_path / "sf", theirs)), **run)
    fresh, _ = built(tiny_world, tmp_path, **run)
    assert_started_from(warm, fresh, theirs, head_fresh=False)
    assert any("SpecForge's layout" in n for n in notes), notes


def test_a_modelopt_dflash_export_starts_a_dflash2_run(tiny_world, tmp_path):
    theirs = source(tiny_world, "dflash", block_size=4)
    warm, _ = built(tiny_world, tmp_path, init_drafter=str(write_modelopt(tmp_path / "mo", theirs)), **D2)
    fresh, _ = built(tiny_world, tmp_path, **D2)
    assert_started_from(warm, fresh, theirs, head_fresh=True)


def test_a_head_whose_tensors_are_the_blocks_starts_fresh_at_another_block(tiny_world, tmp_path):
    from dflash.train.exports.export import export_drafter

    run = {"drafter_type": "xpress", "xpress_rank": 16, "xpress_mlp_hidden": 32, "xpress_topc": 8}
    settings = {k: v for k, v in run.items() if k != "drafter_type"}
    theirs = source(tiny_world, "xpress", block_size=4, **settings)
    drafter_dir = export_drafter(theirs, tmp_path / "ours")
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(drafter_dir), block_size=8, **run)
    fresh, _ = built(tiny_world, tmp_path, block_size=8, **run)
    assert_started_from(warm, fresh, theirs, head_fresh=True)
    assert any("block 4 -> 8" in n and "XPress's" in n for n in notes), notes


def misfits(error) -> list[tuple]:
    """What a `train.init-drafter-misfit` refusal names: (field, theirs, the target's) and (flag, here, there)."""
    assert error.code == "train.init-drafter-misfit", error
    return [tuple(entry) for entry in error.fields["target"] + error.fields["settings"]]


MISFIT = "train.init-drafter-misfit"


@pytest.mark.parametrize("change, code, found", [
    ({"hidden_size": 48}, MISFIT, ("hidden_size", 48)),
    ({"vocab_size": 128, "draft_vocab_size": 128}, MISFIT, ("vocab_size", 128)),
    ({"aux_hidden_state_layer_ids": [1, 4]}, MISFIT, ("the cache's target layers", [1, 2], [0, 3])),
    ({"mask_token_id": 3}, MISFIT, ("--mask-token-id",)),
    ({"aux_hidden_state_layer_ids": [0, 2]}, "train.drafter-aux-embedding", {"aux": [0, 2]}),  # the embedding output
    ({"draft_vocab_size": 32}, "train.drafter-draft-vocab", {"draft_vocab": 32}),
    ({"sample_from_anchor": True}, "train.drafter-anchor-drafts", {"key": "sample_from_anchor"}),
])
def test_a_speculators_drafter_of_another_target_or_reading_other_layers_is_refused_naming_the_field(
        tiny_world, tmp_path, change, code, found):
    theirs = source(tiny_world, "dflash", block_size=4)
    drafter_dir = write_speculators(tmp_path / "spec", theirs, tiny_world["target"], **change)
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dflash")
    assert e.value.fields["init"] == str(drafter_dir)
    if code == MISFIT:
        assert any(entry[:len(found)] == found for entry in misfits(e.value)), e.value.fields
    else:  # the reader's finding, as the cause of the refusal
        cause = e.value.fields["cause"]
        assert e.value.code == "train.init-drafter-unreadable" and cause.code == code
        assert found.items() <= cause.fields.items(), cause


@pytest.mark.parametrize("key, value", [("hidden_size", 64), ("vocab_size", 128), ("num_target_layers", 6)])
def test_a_zlab_drafter_of_another_target_is_refused_naming_the_field(tiny_world, tmp_path, key, value):
    drafter_dir = write_zlab(tmp_path / "zlab", source(tiny_world, "dflash", block_size=4))
    config = json.loads((drafter_dir / "config.json").read_text())
    config[key] = value
    (drafter_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dflash")
    assert [entry[:2] for entry in misfits(e.value)] == [(key, value)]
    assert not e.value.fields["missing"] and not e.value.fields["shapes"]  # the field, not the tensors it explains


def test_a_modelopt_dspark_export_is_refused_naming_its_anchor_alignment(tiny_world, tmp_path):
    drafter_dir = write_modelopt(tmp_path / "mo", source(tiny_world, "dflash", block_size=4), dspark=True)
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dspark", markov_rank=16)
    cause = e.value.fields["cause"]
    assert (cause.code, cause.fields) == ("train.drafter-anchor-drafts", {"key": "dflash_config.shift_label"})


def test_another_trainers_layout_is_one_registration(tiny_world, tmp_path):
    from dflash.train.exports import drafter_layouts as layouts
    from dflash.train.exports.export import config_from_export, read_export_weights

    theirs = source(tiny_world, "dflash", block_size=4)
    drafter_dir = write_zlab(tmp_path / "other", theirs)
    config = json.loads((drafter_dir / "config.json").read_text())
    config["other_trainer"] = {"layers": config.pop("dflash_config")}
    del config["architectures"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dflash")
    assert e.value.fields["cause"].code == "train.drafter-layout-unknown"
    assert e.value.fields["cause"].fields["file"] == str(drafter_dir / "config.json")

    def read(path, cfg, target_config):
        hf = {**cfg, "dflash_config": cfg["other_trainer"]["layers"]}
        return config_from_export(hf, target_config), read_export_weights(path)

    layouts.register_layout(layouts.DrafterLayout("other", "the other trainer's layout", lambda c: "other_trainer" in c,
                                                  read))
    try:
        assert layouts.layout_names()[-2:] == ("other", "export")  # the broad DFlash layout stays last
        warm, notes = built(tiny_world, tmp_path, init_drafter=str(drafter_dir), drafter_type="dflash")
    finally:
        layouts.unregister_layout("other")
    fresh, _ = built(tiny_world, tmp_path, drafter_type="dflash")
    assert_started_from(warm, fresh, theirs, head_fresh=False)
    assert any("the other trainer's layout" in n for n in notes)

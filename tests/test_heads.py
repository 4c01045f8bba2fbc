"""Drafter heads are registrations (train/heads/): no product module outside the heads tests the
drafter type by name, and a head declared in the tests directory (tests/toy_head.py) trains,
resumes bit-exact, exports, reloads and decodes losslessly without a product file knowing it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.train import heads
from dflash.train.run.loop import train

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("runtime", "cache_tools", "extract", "train", "eval", "prepare", "demo")
HEAD_MODULES = ("train/heads/", "train/heads/dflash2/modules.py")  # the heads, and DFlash2's modules and arithmetic
NAMES = {"dflash", "dflash2", "DFlashDraftModel", "DFlash2DraftModel"}
HEAD_ATTRIBUTES = {"candidate_selector", "attention_conv", "mlp_conv"}


def _literals(node: ast.AST) -> set[str]:
    """The string constants of `node`, itself or inside a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def branches_on_a_head(source: str) -> list[str]:
    """Where `source` tests the drafter type by name: a comparison with a head's name or
    architecture (==, in), a dict keyed by one, or a head's own module reached by its attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = set().union(*(_literals(n) for n in [node.left, *node.comparators])) & NAMES
            if named:
                found.append(f"line {node.lineno}: compares with {sorted(named)}")
        elif isinstance(node, ast.Dict):
            named = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in NAMES}
            if named:
                found.append(f"line {node.lineno}: a dict keyed by {sorted(named)}")
        elif isinstance(node, ast.Attribute) and node.attr in HEAD_ATTRIBUTES:
            found.append(f"line {node.lineno}: reaches .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and _literals(node.args[1]) & HEAD_ATTRIBUTES):
            found.append(f"line {node.lineno}: {node.func.id} of {sorted(_literals(node.args[1]))}")
    return found


def test_no_product_module_outside_the_heads_tests_the_drafter_type_by_name():
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name.startswith(HEAD_MODULES):
                continue
            if hits := branches_on_a_head(path.read_text()):
                found[name] = hits
    assert not found, f"branches on a drafter type outside train/heads/: {found}"


@pytest.mark.parametrize("source", [
    'if config.drafter_type == "dflash2":\n    pass',
    'x = c.drafter_type in ("dflash", "dflash2")',
    'ARCHITECTURES = {"dflash": "DFlashDraftModel"}',
    'if drafter.candidate_selector is not None:\n    pass',
    'selector = getattr(model, "candidate_selector", None)',
])
def test_the_scan_sees_each_kind_of_branch(source):
    assert branches_on_a_head(source)


def test_the_scan_lets_names_pass_that_decide_nothing():
    assert not branches_on_a_head('"""DFlash2: a docstring."""\nDEFAULT = "dflash2"\nhead = get_head(name)\n')


# -- the registry ------------------------------------------------------------------------------


def test_the_registry_names_the_heads_and_refuses_an_unknown_one():
    assert heads.head_names()[:2] == ("dflash", "dflash2")
    assert heads.head_for_architecture(["DFlash2DraftModel"]) is heads.get_head("dflash2")
    assert heads.get_head(None) is heads.get_head("dflash")  # a drafter recorded before heads had names
    with pytest.raises(ValueError) as refused:
        heads.get_head("nope")
    assert refused.value.code == "train.unknown-head" and refused.value.fields["name"] == "nope"
    assert refused.value.fields["heads"][:2] == ["dflash", "dflash2"]
    with pytest.raises(ValueError, match="registered already"):
        heads.register_head(heads.get_head("dflash2"))


# -- a head from the tests directory ---------------------------------------------------------------


STEPS = 6
SETTINGS = dict(max_steps=STEPS, epochs=2, grad_accum=1, seed=3, save_interval=2, num_workers=0, eval_fraction=0.0,
                compile=False, drafter_type="toy")


@pytest.fixture()
def toy():
    from toy_head import HEAD

    heads.register_head(HEAD)
    HEAD.calls, HEAD.stop_at_call = 0, 0
    yield HEAD
    heads.unregister_head(HEAD.name)


def test_a_head_registered_from_outside_trains_resumes_exports_and_decodes_losslessly(toy, tiny_world, tmp_path):
    from dflash.eval.speculative import DecodeConfig, speculative_generate, target_generate
    from dflash.train.exports.export import load_drafter
    from transformers import AutoModelForCausalLM

    world = tiny_world
    whole = train(tiny_train_config(world["cache"], world["target"], tmp_path / "whole", **SETTINGS))
    assert whole.exit_status == 0 and whole.step == STEPS
    weights = final_weights(tmp_path / "whole")
    assert "toy_residual.weight" in weights and weights["toy_residual.weight"].abs().sum() > 0  # the head trained

    # stopped (SIGINT) during step 3, then resumed: the same weights, bit for bit
    toy.calls, toy.stop_at_call = 0, 3
    stopped = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert stopped.exit_status != 0 and stopped.step == 3
    toy.stop_at_call = 0
    resumed = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert resumed.exit_status == 0 and resumed.step == STEPS
    assert_same_weights(final_weights(tmp_path / "resumed"), weights)

    # the export is the head's: its architecture, its keys, its tensors
    export = whole.final_dir
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["ToyDraftModel"] and config["dflash_config"]["toy_residual"] is True
    drafter = load_drafter(export, world["target"])
    assert drafter.head is toy and drafter.config.drafter_type == "toy"
    assert torch.equal(drafter.toy_residual.weight, weights["toy_residual.weight"].bfloat16().float())  # (a bf16 export)

    # its decode step drafts, and the output is the target's own
    from dflash.eval.speculative import DrafterProposer

    assert DrafterProposer(drafter, 4).walk is not None  # the toy's step, not the backbone's argmax
    target = AutoModelForCausalLM.from_pretrained(str(world["target"]), dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 20, 4, 1]]
    decode = DecodeConfig(max_new_tokens=12)
    drafted = speculative_generate(target, drafter, prompts, decode)
    assert [g.tokens for g in drafted] == [g.tokens for g in target_generate(target, prompts, decode)]


def test_an_unregistered_head_is_refused_by_the_settings(tiny_world, tmp_path):
    from dflash.train.config import TrainConfigError

    with pytest.raises(TrainConfigError) as refused:
        tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", drafter_type="toy")
    assert refused.value.code == "train.setting-choice"
    assert (refused.value.fields["flag"], refused.value.fields["value"]) == ("--drafter-type", "toy")
    assert "toy" not in refused.value.fields["choices"] and "dflash" in refused.value.fields["choices"]


def test_an_export_of_a_head_the_runtime_does_not_list_is_refused_as_a_target(tmp_path):
    from dflash.runtime.safetensors_files import DrafterAsTargetError, refuse_drafter_as_target

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyDraftModel"], "dflash_config": {}}))
    with pytest.raises(DrafterAsTargetError):
        refuse_drafter_as_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    refuse_drafter_as_target(tmp_path)  # a target passes


@pytest.mark.parametrize("name", heads.head_names())
def test_each_heads_memory_counts_the_parameters_it_builds_and_the_estimate_adds_them(name):
    """`DraftHead.memory`: the parameters the startup check's estimate counts for a head are those of
    the drafter it builds (train/run/memory.py reads no head by name), and its terms add to DFlash's."""
    from dflash.train.model.drafter import DFlashDrafter
    from dflash.train.model.drafter_config import DrafterConfig
    from dflash.train.model.target_weights import TargetWeights
    from dflash.train.run.memory import Dims, MicroBatch, estimate_step_memory

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=96, num_target_layers=2, num_hidden_layers=2, target_layer_ids=[0, 1], block_size=8)
    config = DrafterConfig(**shape, drafter_type=name, attention_backend="sdpa")
    drafter = DFlashDrafter(config, TargetWeights(torch.randn(96, 64), torch.randn(96, 64)))
    plain = DFlashDrafter(DrafterConfig(**shape, drafter_type="dflash", attention_backend="sdpa"),
                          TargetWeights(torch.randn(96, 64), torch.randn(96, 64)))
    dims, dflash = Dims.of(config), Dims.of(plain.config)
    own = sum(p.numel() for p in drafter.parameters()) - sum(p.numel() for p in plain.parameters())
    assert dims.head.params == own
    assert dims.trainable_params() - dflash.trainable_params() == own
    batch = MicroBatch(2, 64, 32)
    assert estimate_step_memory(dims, batch).total >= estimate_step_memory(dflash, batch).total

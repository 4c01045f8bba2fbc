"""The identities a resume must match are built from the settings' own marks (`setting(identity=...)`),
and they are the ones the hand-written lists built before: a checkpoint or a cache written before
the marks resumes as it did. The reference functions below are those lists as they were."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from conftest import tiny_train_config
from dflash.cache_tools.identity import comparable, target_identity
from dflash.extract.config import ExtractConfig
from dflash.runtime.positions import TargetPositions
from dflash.runtime.settings import Identity, identity_of, section, setting

# -- the hand-written identities, as they were -------------------------------------------------


def former_run_identity(cfg, data, drafter, target_config, info):
    c = drafter.config
    return {
        "caches": data.caches.identity(),
        "eval_caches": data.eval_caches.identity() if data.eval_caches is not None else [],
        "eval_fraction": 0.0 if cfg.data.eval_cache else cfg.data.eval_fraction,
        "eval_split": "sample_id hash",
        **({"max_train_samples": cfg.data.max_train_samples} if cfg.data.max_train_samples else {}),
        "target": comparable(target_identity(target_config, cfg.model.target_model)),
        "batching": {"token_budget": cfg.data.token_budget, "max_batch_size": cfg.data.max_batch_size,
                     "max_seq_len": cfg.data.max_seq_len, "shuffle_window": cfg.data.shuffle_window,
                     "seed": cfg.optimization.seed, "sample_order": "sample_id",
                     **({"shuffle_parts": cfg.data.shuffle_parts} if cfg.data.shuffle_parts else {}),
                     "batches_per_step (world_size x grad_accum)": info.world_size * cfg.optimization.grad_accum},
        "model": {"num_draft_layers": c.num_hidden_layers, "block_size": c.block_size,
                  "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                  "layer_types": list(c.layer_types), "sliding_window": c.sliding_window, "causal": c.causal,
                  **drafter.head.identity(c)},
    }


def former_content_settings(config, positions=None):
    return {
        "max_seq_len": config.sample_limit(positions),
        "long_samples": config.long_samples,
        "skip_bad": config.skip_bad,
        "dtype": config.dtype,
        "part_tokens": config.part_tokens,
        "sort_window_tokens": config.window_tokens(),
        "store_last_hidden": config.store_last_hidden,
        "store_topk": config.store_topk,
    }


def as_json(identity: dict) -> dict:
    """An identity as meta.json and the manifest keep it (and check_resume compares it)."""
    return json.loads(json.dumps(identity, default=str))


# -- the run identity --------------------------------------------------------------------------


def target_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)


def stand_ins(cfg, world_size: int):
    """The run's data, drafter and ranks as run_identity reads them (a real DrafterConfig)."""
    from dflash.train.heads import get_head
    from dflash.train.model.drafter_config import DrafterConfig

    config = DrafterConfig.from_target_config(target_config(), target_layer_ids=[1, 4, 6],
                                              **cfg.model.drafter_overrides())
    caches = SimpleNamespace(identity=lambda: [{"identity": {"data": {"sha256": "ab"}}, "samples": 3}])
    evals = SimpleNamespace(identity=lambda: [{"identity": {"data": {"sha256": "cd"}}, "samples": 1}])
    data = SimpleNamespace(caches=caches, eval_caches=evals if cfg.data.eval_cache else None)
    drafter = SimpleNamespace(config=config, head=get_head(config.drafter_type))
    return data, drafter, SimpleNamespace(world_size=world_size)


RUNS = {
    "defaults (dflash2)": ({}, 1),
    "dflash": ({"drafter_type": "dflash"}, 1),
    "held-out cache, sample cap, part groups, ranks": (
        {"eval_cache": ["held"], "max_train_samples": 100, "shuffle_parts": 8, "grad_accum": 3, "seed": 7}, 2),
    "sliding causal layers, mask id": (
        {"num_draft_layers": 2, "draft_layer_types": "sliding,full", "draft_sliding_window": 32,
         "draft_causal": True, "mask_token_id": 5, "block_size": 8, "drafter_type": "dflash"}, 4),
    "dspark": ({"drafter_type": "dspark", "markov_rank": 32}, 1),
    "settings that may change on resume": ({"lr": 3e-4, "epochs": 3, "eval_fraction": 0.1, "num_workers": 2}, 1),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_run_identity_from_the_settings_marks_is_the_one_recorded_before(name, tmp_path):
    from dflash.train.run.resume import run_identity

    overrides, world_size = RUNS[name]
    cfg = tiny_train_config(tmp_path / "cache", tmp_path / "target", tmp_path / "run", **overrides)
    data, drafter, info = stand_ins(cfg, world_size)
    derived = run_identity(cfg, data, drafter, target_config(), info)
    assert as_json(derived) == as_json(former_run_identity(cfg, data, drafter, target_config(), info))


def test_a_setting_not_marked_leaves_the_run_identity_as_it_is(tmp_path):
    from dflash.train.run.resume import run_identity

    one = tiny_train_config(tmp_path / "c", tmp_path / "t", tmp_path / "r", lr=1e-3, epochs=2)
    other = tiny_train_config(tmp_path / "c", tmp_path / "t", tmp_path / "r", lr=5e-4, epochs=4, grad_clip=0.5)
    marked = tiny_train_config(tmp_path / "c", tmp_path / "t", tmp_path / "r", token_budget=256)
    identity = [as_json(run_identity(c, *stand_ins(c, 1)[:2], target_config(), stand_ins(c, 1)[2]))
                for c in (one, other, marked)]
    assert identity[0] == identity[1]
    assert identity[2]["batching"]["token_budget"] == 256 != identity[0]["batching"]["token_budget"]


# -- the cache's content settings --------------------------------------------------------------

EXTRACTIONS = {
    "defaults": ({}, None),
    "held to the target's positions": ({"max_seq_len": 4096}, TargetPositions(2048, "max_position_embeddings 2048")),
    "within the target's positions": ({"max_seq_len": 512}, TargetPositions(2048, "max_position_embeddings 2048")),
    "every content setting given": ({"long_samples": "skip", "skip_bad": True, "dtype": "float32",
                                     "part_tokens": 1000, "sort_window_tokens": 0, "store_last_hidden": True,
                                     "store_topk": 0, "codec": "fp8", "chunk_rows": 64}, None),
    "a sort window": ({"part_tokens": 1000, "sort_window_tokens": 50_000}, None),
}


@pytest.mark.parametrize("name", list(EXTRACTIONS))
def test_the_caches_content_settings_from_the_marks_are_the_ones_recorded_before(name, tmp_path):
    overrides, positions = EXTRACTIONS[name]
    config = ExtractConfig(target_model="t", data="d", output=str(tmp_path / "c"), rank=0, world_size=1, **overrides)
    assert as_json(config.content_settings(positions)) == as_json(former_content_settings(config, positions))


# -- the mechanism -----------------------------------------------------------------------------


@section
@dataclass(kw_only=True)
class Shape:
    width: int = setting(4, identity="shape")
    depth: int = setting(2, identity=Identity("shape", source="resolved_depth"))
    late: int = setting(0, identity=Identity("shape", omit_default=True))
    noise: float = 0.1

    @property
    def resolved_depth(self) -> int:
        return self.depth * 10


@dataclass(kw_only=True)
class Toy:
    shape: Shape
    seed: int = setting(0, identity=True)
    steps: tuple[int, int] = setting((1, 2), identity=Identity(key="span"))
    lr: float = 1e-3


def test_identity_of_gathers_the_marked_settings_by_group_key_source_and_default():
    toy = Toy(shape=Shape(), seed=3)
    assert identity_of(toy) == {"shape": {"width": 4, "depth": 20}, "seed": 3, "span": [1, 2]}
    toy = Toy(shape=Shape(late=5, noise=0.5), lr=1.0)
    assert identity_of(toy)["shape"] == {"width": 4, "depth": 20, "late": 5}  # the unmarked ones never enter
    resolved = SimpleNamespace(width=8, resolved_depth=3, late=0)
    assert identity_of(toy, resolved={"shape": resolved}, values={"seed": 9}) == {
        "shape": {"width": 8, "depth": 3}, "seed": 9, "span": [1, 2]}


# -- dflash-eval's measurement takes the command's settings, declared once ---------------------


def test_run_eval_takes_the_eval_settings_and_the_command_adds_only_what_it_does_with_the_report():
    import inspect

    from dflash.eval.cli import EvalCommandConfig
    from dflash.eval.config import EvalConfig
    from dflash.eval.run import run_eval
    from dflash.runtime.settings import settings_of

    assert list(inspect.signature(run_eval).parameters) == ["config"]
    assert issubclass(EvalCommandConfig, EvalConfig)
    assert set(settings_of(EvalCommandConfig)) - set(settings_of(EvalConfig)) == {"strict", "as_json", "update_card"}


def test_an_eval_setting_out_of_range_is_refused_when_the_settings_are_built():
    from dflash.eval.config import EvalConfig, EvalError

    for bad in ({"batch_size": 0}, {"lookup_ngram": 0}):
        with pytest.raises(EvalError):
            EvalConfig(target_model="t", drafter="d", prompts=["p"], **bad)


# -- choices live once -------------------------------------------------------------------------


def test_no_tuple_of_choices_is_spelled_twice_in_the_product_code():
    import ast
    from collections import defaultdict
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spelled: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for package in ("runtime", "cache_tools", "extract", "prepare", "train", "eval", "demo"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
                if (isinstance(value, ast.Tuple) and len(value.elts) >= 2
                        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)):
                    spelled[tuple(e.value for e in value.elts)].append(f"{path.relative_to(root)}:{node.lineno}")
    assert {names: where for names, where in spelled.items() if len(where) > 1} == {}

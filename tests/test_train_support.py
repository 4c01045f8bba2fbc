"""Tiny targets and caches for the trainer tests, and tests of the trainer's pure pieces:
batch plans, the resumable loader position, the schedule and the config file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import make_header
from dflash.cache_tools.writer import CacheWriter
from dflash.train.config import TrainConfig, TrainConfigError, load_config_file, make_config
from dflash.train.loader import CacheSet, LoaderConfig, TrainLoader, eval_split, plan_epoch
from dflash.train.loop import lr_multiplier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

HIDDEN, VOCAB, TARGET_LAYERS, LAYERS = 32, 64, 4, (1, 2)


def save_tiny_target(path: Path, *, hidden: int = HIDDEN, layers: int = TARGET_LAYERS, vocab: int = VOCAB) -> Path:
    config = Qwen3Config(hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=64, vocab_size=vocab, num_hidden_layers=layers,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def tiny_cache_header(*, layers=LAYERS, hidden: int = HIDDEN, target_layers: int = TARGET_LAYERS,
                      vocab: int = VOCAB, data: str = "tiny") -> dict:
    return make_header(
        target={"path": "tiny-target", "architecture": "Qwen3ForCausalLM", "hidden_size": hidden,
                "num_hidden_layers": target_layers, "vocab_size": vocab},
        target_layer_ids=list(layers), hidden_size=hidden, codec=HiddenCodec(name="bf16"),
        chunk_rows=16, shard_rows=64, data={"name": data},
    )


def write_tiny_cache(path: Path, *, samples: int = 48, parts: int = 4, seed: int = 0, min_len: int = 12,
                     max_len: int = 48, **header_kw) -> Path:
    """Random samples whose completions (loss_mask 1) start after a short prompt."""
    header = tiny_cache_header(**header_kw)
    width = len(header["target_layer_ids"]) * header["hidden"]["hidden_size"]
    writer = CacheWriter(path, header)
    gen = torch.Generator().manual_seed(seed)
    per_part = samples // parts
    for p in range(parts):
        with writer.part_writer(f"part-{p:06d}") as pw:
            for s in range(per_part):
                n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
                ids = torch.randint(0, header["target"]["vocab_size"] - 1, (n,), generator=gen)
                mask = torch.ones(n, dtype=torch.uint8)
                mask[: n // 4] = 0
                hidden = torch.randn(n, width, generator=gen).to(torch.bfloat16)
                pw.add_sample(p * per_part + s, ids, mask, hidden)
    return path


def tiny_train_config(cache: Path | list[Path], target: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(
        cache=[str(c) for c in (cache if isinstance(cache, list) else [cache])], target_model=str(target),
        output_dir=str(out), num_draft_layers=1, block_size=4, max_anchors=4, token_budget=128,
        max_batch_size=4, max_seq_len=64, shuffle_window=16, num_workers=0, epochs=2, log_interval=1,
        eval_interval=0, save_interval=0, lr=1e-3, progress=False, tensorboard=False,
        attention_backend="sdpa",
    )
    values.update(overrides)
    return TrainConfig(**values)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The float32 weights of the run's latest checkpoint."""
    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(latest / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


_WORLD: dict[str, Path] = {}


def build_tiny_world(tmp_path_factory) -> dict[str, Path]:
    """One tiny target and one tiny cache, built once per test session (read-only for tests)."""
    if not _WORLD:
        root = tmp_path_factory.mktemp("tiny-world")
        _WORLD.update(target=save_tiny_target(root / "target"), cache=write_tiny_cache(root / "cache"))
    return dict(_WORLD)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_world(tmp_path_factory)


# -- batch plans and the loader position --------------------------------------------------------


def _loader_config(**kw) -> LoaderConfig:
    return LoaderConfig(**{**dict(token_budget=128, max_batch_size=4, max_seq_len=64, shuffle_window=16,
                                  seed=3, num_workers=0), **kw})


def test_epoch_plans_are_a_pure_function_of_seed_epoch_and_lengths():
    lengths = np.random.default_rng(0).integers(5, 64, size=200)
    index = np.arange(200)
    config = _loader_config()
    a, b = plan_epoch(index, lengths, config, 1), plan_epoch(index, lengths, config, 1)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    other_epoch = plan_epoch(index, lengths, config, 2)
    assert [x.tolist() for x in a] != [x.tolist() for x in other_epoch]
    # every sample exactly once, each batch under the token budget and the size limit
    assert sorted(np.concatenate(a).tolist()) == list(range(200))
    assert all(len(x) * lengths[x].max() <= 128 and len(x) <= 4 for x in a)


def test_length_bucketing_keeps_padding_low():
    lengths = np.random.default_rng(1).integers(8, 512, size=4000)
    config = _loader_config(token_budget=2048, max_batch_size=64, max_seq_len=512, shuffle_window=1024)
    batches = plan_epoch(np.arange(4000), lengths, config, 0)
    padded = sum(len(x) * lengths[x].max() for x in batches)
    assert lengths.sum() / padded > 0.9


def test_resumed_loader_yields_exactly_the_remaining_batches(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    index = np.arange(len(caches))

    def loader() -> TrainLoader:
        return TrainLoader(caches, index, _loader_config(), epochs=3, grad_accum=2)

    full = loader()
    total = 2 * sum(full.steps_per_epoch)
    reference = [full.next_batch()["sample_ids"].tolist() for _ in range(total)]
    first = loader()
    for _ in range(2 * (full.steps_per_epoch[0] + 1)):  # into the second epoch
        first.next_batch()
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.next_batch()["sample_ids"].tolist() for _ in range(total - 2 * (full.steps_per_epoch[0] + 1))]
    assert rest == reference[len(reference) - len(rest):]


def test_ranks_split_each_step_of_the_global_batch_list(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    index = np.arange(len(caches))
    single = TrainLoader(caches, index, _loader_config(), epochs=1, grad_accum=2)
    ranks = [TrainLoader(caches, index, _loader_config(), epochs=1, rank=r, world_size=2) for r in range(2)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch
    for _ in range(single.steps_per_epoch[0]):
        one = {tuple(single.next_batch()["sample_ids"].tolist()) for _ in range(2)}
        two = {tuple(r.next_batch()["sample_ids"].tolist()) for r in ranks}
        assert one == two


def test_eval_split_is_stable_and_disjoint(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    train_a, eval_a = eval_split(caches, 0.25)
    train_b, eval_b = eval_split(caches, 0.25)
    assert np.array_equal(eval_a, eval_b) and 0 < len(eval_a) < len(caches)
    assert not set(train_a.tolist()) & set(eval_a.tolist())


def test_schedule_warms_up_then_decays_to_the_floor():
    f = [lr_multiplier(s, total_steps=100, warmup_ratio=0.04, min_lr_ratio=0.1) for s in range(101)]
    assert f[0] == 0.25 and f[3] == 1.0 and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert abs(f[100] - 0.1) < 1e-9


def test_config_file_values_are_overridden_by_flags_and_unknown_keys_are_errors(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"cache": "c", "target-model": "t", "output_dir": "o", "lr": "3e-4",
                                "adam_betas": [0.9, 0.95], "compile": "false"}))
    config = make_config(load_config_file(path), {"lr": 1e-3, "seed": None})
    assert config.lr == 1e-3 and config.adam_betas == (0.9, 0.95) and config.compile is False
    assert config.cache == ["c"]
    path.write_text(json.dumps({"cache": "c", "learning_rate": 1}))
    with pytest.raises(TrainConfigError, match="unknown setting.*learning_rate"):
        load_config_file(path)
    path.write_text(json.dumps({"cache": "c", "target_model": "t", "output_dir": "o", "epochs": "many"}))
    with pytest.raises(TrainConfigError, match="epochs = 'many' is invalid"):
        make_config(load_config_file(path), {})
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("cache: [a, b]\ntarget-model: t\noutput_dir: o\nmax_steps: 5\n")
    pytest.importorskip("yaml")
    assert make_config(load_config_file(yaml_path), {}).cache == ["a", "b"]

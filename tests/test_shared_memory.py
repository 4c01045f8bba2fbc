"""The loader's batches in flight fit the host's shared memory: a run lowers --prefetch-factor, then
--num-workers, to what fits /dev/shm and says so (a worker that fills it dies of SIGBUS mid-run),
and trains on the same batches, so to the same weights, as with the workers it was given."""

from __future__ import annotations

import pytest
from cache_utils import tiny_header
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.cache_tools.schema import PartSchema
from dflash.runtime.findings import collected
from dflash.train.config import DataConfig
from dflash.train.data import shared_memory
from dflash.train.data.shared_memory import FILL, fit_shared_memory, token_bytes

MB = 2**20


def _config(workers: int, prefetch: int) -> DataConfig:
    return DataConfig(cache=["c"], num_workers=workers, prefetch_factor=prefetch)


@pytest.mark.parametrize("free_batches,loaders,fit", [
    (16, 1, None),  # 4 x 4 fit: unchanged
    (9, 1, (4, 2)),  # the prefetch first
    (3, 1, (3, 1)),  # then the workers
    (0.5, 1, (0, 1)),  # not one batch: the trainer's process reads
    (16, 2, (4, 2)),  # an evaluation's loader beside the training one's
])
def test_the_batches_in_flight_are_cut_to_what_fits(free_batches, loaders, fit):
    config = _config(4, 4)
    free = int(free_batches * 100 * MB / FILL)
    notice = fit_shared_memory(config, 100 * MB, loaders, free)
    if fit is None:
        assert notice is None and (config.num_workers, config.prefetch_factor) == (4, 4)
        return
    assert (config.num_workers, config.prefetch_factor) == fit
    assert notice.code == "train.shared-memory"
    assert notice.fields == dict(path="/dev/shm", free=free, batch_bytes=100 * MB, loaders=loaders, workers=4,
                                 prefetch=4, fit_workers=fit[0], fit_prefetch=fit[1])


def test_nothing_is_cut_without_workers_or_where_the_host_has_no_shared_memory():
    assert fit_shared_memory(_config(0, 4), 100 * MB, 1, 1) is None
    config = _config(4, 4)
    assert fit_shared_memory(config, 100 * MB, 1, None) is None and config.num_workers == 4


def test_a_token_of_a_batch_is_bounded_by_its_decoded_states_and_its_other_values():
    schema = PartSchema.from_header(tiny_header("fp8", layers=(1, 3), hidden_size=32, topk=8))
    # hidden decoded to bf16 (2 x 32 x 2 B), its fp8 scale (2 values), the top-8 ids and log-probs,
    # input_ids and loss_mask, each other value as 8 bytes
    assert token_bytes(schema) == 2 * 32 * 2 + 8 * (2 + 8 + 8 + 1 + 1)


def test_a_run_whose_shared_memory_is_small_says_so_and_trains_to_the_same_weights(tiny_world, tmp_path,
                                                                                  monkeypatch):
    from dflash.train.run.loop import train

    def run(name):
        cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / name, epochs=1,
                                num_workers=2, prefetch_factor=4)
        with collected() as found:
            assert train(cfg).exit_status == 0
        return final_weights(tmp_path / name), [f for f in found if f.code == "train.shared-memory"]

    roomy, none = run("roomy")
    assert none == []
    monkeypatch.setattr(shared_memory, "shm_free_bytes", lambda: 1)  # not one batch fits
    cramped, [notice] = run("cramped")
    assert (notice.fields["workers"], notice.fields["prefetch"]) == (2, 4)
    assert (notice.fields["fit_workers"], notice.fields["fit_prefetch"]) == (0, 1)
    assert_same_weights(roomy, cramped)

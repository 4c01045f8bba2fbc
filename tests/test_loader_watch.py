"""A run whose GPU waits for the loader says so once, past its first logged span (compilation and the
workers' start), naming its workers and cores; a follow run (it waits for the extraction by design)
and a CPU run (its workers share the training's cores) are not told."""

from __future__ import annotations

import time

from conftest import tiny_train_config
from dflash.runtime.findings import codes, collected
from dflash.train.measure.loader_watch import LOADER_BOUND, LoaderWatch


def test_the_watch_tells_once_past_the_first_span_and_only_where_it_watches():
    watch = LoaderWatch(workers=2, cores=16, watching=True)
    assert watch.observe(10, 0.9) is None  # the first span holds the compilation and the workers' start
    assert watch.observe(20, LOADER_BOUND / 2) is None
    notice = watch.observe(30, 0.4)
    assert notice.code == "train.loader-bound"
    assert notice.fields == dict(step=30, data_wait=0.4, workers=2, threads=4, cores=16)
    assert watch.observe(40, 0.8) is None  # once a run
    quiet = LoaderWatch(workers=2, cores=16, watching=False)  # a follow run, or a run on the CPU
    assert [quiet.observe(step, 0.9) for step in (10, 20, 30)] == [None] * 3
    assert LoaderWatch(workers=2, cores=16, watching=True).observe(10, float("nan")) is None


def _slow_reads(monkeypatch, seconds: float) -> None:
    from dflash.train.data import loader

    read = loader.read_batch

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return read(*args, **kwargs)

    monkeypatch.setattr(loader, "read_batch", slow)


def test_a_run_whose_steps_wait_for_batches_names_the_wait_its_workers_and_its_cores(tiny_world, tmp_path,
                                                                                     monkeypatch):
    from dflash.train.run import loop

    _slow_reads(monkeypatch, 0.2)  # reading, not training, takes the run's time
    watched = []

    def on_a_gpu(**kwargs):  # the run as on a GPU: the watch a CUDA run builds
        watched.append(LoaderWatch(**{**kwargs, "watching": True}))
        return watched[-1]

    monkeypatch.setattr(loop, "LoaderWatch", on_a_gpu)
    cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", max_steps=6,
                            log_interval=2)
    with collected() as found:
        assert loop.train(cfg).exit_status == 0
    [notice] = [f for f in found if f.code == "train.loader-bound"]
    assert notice.fields["step"] == 4 and notice.fields["data_wait"] >= LOADER_BOUND
    assert notice.fields["workers"] == cfg.data.num_workers == 0 and notice.fields["cores"] >= 1
    assert notice.fields["threads"] >= 1
    assert watched[0].spans == 3


def test_a_cpu_run_is_not_told_of_its_loader(tiny_world, tmp_path, monkeypatch):
    from dflash.train.run.loop import train

    _slow_reads(monkeypatch, 0.2)
    cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", max_steps=6,
                            log_interval=2)
    with collected() as found:
        assert train(cfg).exit_status == 0
    assert "train.loader-bound" not in codes(found)

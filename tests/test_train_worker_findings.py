"""An error a DataLoader worker meets reading a batch reaches the trainer as WorkerReadError with
the worker's finding (code and fields), read back from the text torch re-raises it with."""

from __future__ import annotations

from dflash.cache_tools.errors import CacheCorruptError
from dflash.runtime.errors import CorruptDataError
from dflash.runtime.findings import Finding
from dflash.train.data.loader import WorkerReadError
from torch._utils import ExceptionWrapper


def _as_torch_reraises(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapped.reraise()
    except BaseException as reraised:
        return reraised
    raise AssertionError("not re-raised")


def test_a_workers_finding_reaches_the_trainer_with_its_code_and_fields():
    found = Finding("train.samples-over-token-budget", samples=2, token_budget=16, longest=40, max_seq_len=64)
    got = _as_torch_reraises(WorkerReadError.sent(CacheCorruptError(found)))
    assert type(got) is WorkerReadError and isinstance(got, CorruptDataError)
    assert got.code == found.code and got.fields == found.fields
    assert str(got) == str(found)  # one paragraph: no traceback, no JSON


def test_a_workers_error_of_plain_words_still_reads_as_its_paragraph():
    got = _as_torch_reraises(WorkerReadError.sent(CacheCorruptError("Chunk 0.0 of c/p-1/hidden is damaged.")))
    assert type(got) is WorkerReadError and got.code is None
    assert str(got) == "Chunk 0.0 of c/p-1/hidden is damaged."

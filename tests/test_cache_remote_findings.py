"""A remote cache's refusals are findings: the part fetched by a fresh process (a forked loader
worker's) comes back to the parent with its class, its code and its fields; a request's failure
states its cause (network, credentials) as data."""

from __future__ import annotations

import subprocess

import pytest
from dflash.cache_tools import remote, remote_store
from dflash.cache_tools.errors import CacheCorruptError
from dflash.runtime.findings import Finding


def test_a_part_fetched_in_a_new_process_raises_its_finding_again_in_the_parent(tmp_path, monkeypatch, capsys):
    refused = CacheCorruptError(Finding("cache.download-corrupt", object="s3://b/c/parts/p/hidden.bin", part="p",
                                        size=3, indexed_size=4, attempts=2, url="s3://b/c"))

    def fail(self, name):
        raise refused

    monkeypatch.setattr(remote.StagedCache, "_fetch_part", fail)
    assert remote._fetch_part_main(["s3://b/c", str(tmp_path), "p", "2", "1"]) == 1
    child_said = capsys.readouterr().err
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", child_said))
    with pytest.raises(CacheCorruptError) as err:
        remote.StagedCache("s3://b/c", tmp_path)._fetch_part_in_new_process("p")
    assert err.value.code == refused.code and err.value.fields == refused.fields
    assert str(err.value) == str(refused)


def test_a_failed_request_names_its_cause_as_data():
    net = remote_store.failure_fields(OSError("error sending request for url (http://127.0.0.1:9/b/k)"))
    creds = remote_store.failure_fields(OSError("status code: 403, InvalidAccessKeyId"))
    other = remote_store.failure_fields(OSError("Debug source: nothing to show"))
    assert (net["cause"], creds["cause"], other["cause"]) == ("network", "credentials", "other")
    text = str(Finding("cache.remote-request-failed", action="fetch", url="s3://b/c/k", **net))
    assert "s3://b/c/k" in text and net["endpoint"] in text

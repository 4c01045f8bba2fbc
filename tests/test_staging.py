"""Disk budgets (cache_tools/staging.py): sizes as users write them, and the budget-plus-one-part rule."""

from __future__ import annotations

import pytest
from dflash.cache_tools.errors import InputError
from dflash.cache_tools.staging import StagingBudget, parse_size


def test_sizes_parse_with_binary_and_decimal_units():
    assert parse_size("4096") == 4096
    assert parse_size("2K") == parse_size("2KiB") == 2048
    assert parse_size("1.5T") == int(1.5 * 2**40)
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(" 3 gb ") == 3 * 10**9
    with pytest.raises(InputError) as e:
        parse_size("12Q")
    assert e.value.code == "cache.size-invalid" and e.value.fields == {"value": "12Q"}


def test_a_budget_admits_one_item_when_empty_and_otherwise_only_what_fits(tmp_path):
    budget = StagingBudget(tmp_path / "d", 1000)
    assert budget.used() == 0 and budget.has_room(5000)  # empty: one item of any size goes in alone
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 600)
    assert budget.used() == 600
    assert budget.has_room(400) and not budget.has_room(401)
    assert not budget.wait_for_room(401, poll_s=0.01, timeout_s=0.05)
    freed = []

    def make_room(needed):
        freed.append(needed)
        (tmp_path / "d" / "a").unlink()
        return True

    assert budget.wait_for_room(700, make_room=make_room, poll_s=0.01)
    assert freed == [300]  # asked for exactly the overshoot
    assert StagingBudget(tmp_path / "d", None).has_room(10**15)

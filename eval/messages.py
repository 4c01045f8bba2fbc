"""What dflash.eval tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import renders  # noqa: F401

"""One exception family for the cache.

Every error carries a sentence that says what was wrong, where, and what to do; the CLIs
catch `DflashError` (the family's base, `dflash.runtime.errors`) once and print that sentence
as one paragraph.
"""

from dflash.runtime.errors import DflashError, InputError  # noqa: F401 (the cache's family shares them)


class CacheError(DflashError):
    """Something is wrong with a cache directory."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """The directory is missing or is not a cache (no manifest)."""


class CacheCorruptError(CacheError):
    """Stored bytes do not match their checksum, or a file is truncated or inconsistent."""


class ConfigMismatchError(CacheError):
    """A cache was opened with settings (model, layers, codec, data) other than its own."""

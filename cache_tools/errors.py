"""One exception family for the cache.

Every error carries a sentence that says what was wrong, where, and what to do; the CLIs
catch `DflashError` once and print that sentence as one paragraph.
"""


class DflashError(Exception):
    """Base of every error the pipeline raises on purpose (bad input, bad cache, bad config)."""


class CacheError(DflashError):
    """Something is wrong with a cache directory."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """The directory is missing or is not a cache (no manifest)."""


class CacheCorruptError(CacheError):
    """Stored bytes do not match their checksum, or a file is truncated or inconsistent."""


class ConfigMismatchError(CacheError):
    """A cache was opened with settings (model, layers, codec, data) other than its own."""


class CacheLockedError(CacheError):
    """Another process holds a lock that this operation needs."""


class InputError(DflashError):
    """A user-supplied file or record is malformed."""

"""The cache's errors, each of one kind of `dflash.runtime.errors`.

Every error carries a sentence that says what was wrong, where, and what to do; the CLIs
catch `DflashError` (the family's base) once and print that sentence as one paragraph.
"""

from dflash.runtime.errors import CorruptDataError, EnvironmentFault, InputError, MismatchError


class CacheError(InputError):
    """A cache directory, or what is given to be written into one, is not usable as it is."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """The directory is missing or is not a cache (no manifest)."""


class CacheStorageError(EnvironmentFault):
    """The cache's location cannot be created or written (read-only, no space, no permission)."""


class CacheCorruptError(CorruptDataError):
    """Stored bytes do not match their checksum, or a file is truncated or inconsistent."""


class ConfigMismatchError(MismatchError):
    """A cache was opened with settings (model, layers, codec, data) other than its own, or by a
    version of the code that reads another format."""

"""The base of the error family: what a CLI reports as one paragraph with exit status 2.

Every error raised on purpose (bad input, bad settings, a damaged cache) derives from
`DflashError`; its message says what was wrong, where, and what to do.
"""


class DflashError(Exception):
    """Base of every error the pipeline raises on purpose (bad input, bad cache, bad config)."""


class InputError(DflashError):
    """A user-supplied file or record is malformed."""


class SettingError(DflashError, ValueError):
    """A flag or config-file setting is missing, unknown, out of range or inconsistent."""

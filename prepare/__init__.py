"""Chat data to training data: `dflash-prepare` (render + masks) and `dflash-generate` (target regeneration)."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

"""Extraction stage: run the frozen target once and fill the hidden-state cache."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

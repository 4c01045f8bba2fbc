"""Evaluation stage: a drafter measured by real speculative decoding against its target."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

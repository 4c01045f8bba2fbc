"""A run's life: the loop, its checkpoints and resume, its processes, its length and its memory."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

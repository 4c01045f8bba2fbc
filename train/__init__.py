"""Training stage: the DFlash drafter, its objective, loaders, loop and export."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

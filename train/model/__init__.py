"""The drafter's network: the DFlash backbone, its layers, attention, masks, RoPE, and what it borrows from the target."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

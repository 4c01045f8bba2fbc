"""What a training step minimises: the objective over a batch's blocks and the losses under the target head."""

from . import messages  # noqa: F401  (registers the loss's finding renderers)

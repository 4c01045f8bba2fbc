"""What a run reads: the caches, the batches drawn from them, their anchors and the held-out split."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

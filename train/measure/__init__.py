"""What a run reports and how drafters are measured: metrics, held-out estimates and comparisons."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

"""dflash-demo: the whole pipeline on an embedded tiny target and data, in one command."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

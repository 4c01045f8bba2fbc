"""The hidden-state cache format: manifest, writer, reader, codecs, and the dflash-cache CLI."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

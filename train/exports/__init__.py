"""Drafters on disk: the export the engines load, its model card, the layouts read to start from one."""

from . import messages  # noqa: F401  (registers the package's finding renderers)

"""Extraction stage: run the frozen target once and fill the hidden-state cache."""

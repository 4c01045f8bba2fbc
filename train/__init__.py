"""Training stage: the DFlash drafter, its objective, loaders, loop and export."""

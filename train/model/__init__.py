"""The drafter's network: the DFlash backbone, its layers, attention, masks, RoPE, and what it borrows from the target."""

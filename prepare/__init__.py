"""Chat data to training data: `dflash-prepare` (render + masks) and `dflash-generate` (target regeneration)."""

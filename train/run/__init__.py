"""A run's life: the loop, its checkpoints and resume, its processes, its length and its memory."""

"""A rank on a worker: the training loop, written once, its control point, its checkpoints and its host."""

"""What every job shares, below the tasks: the Trainer and its callbacks
(:mod:`~posenc.training.runner`, :mod:`~posenc.training.callbacks`), checkpoints,
the optimiser, the learnability gate and the closing summary of a run."""

"""What every job shares, below the tasks: the Trainer and its callbacks
(:mod:`~posenc.training.trainer`, :mod:`~posenc.training.callbacks`), the run
directory (:mod:`~posenc.training.rundir`), checkpoints, the LightningModules' common
part, the optimiser, the learnability gate and the closing summary of a run."""

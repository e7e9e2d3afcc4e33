"""What the three tasks' LightningModules share (:mod:`posenc.tasks`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import pytorch_lightning as pl
from hydra.utils import instantiate
from torch import nn

from posenc.encoders.base import Constrained
from posenc.model import count_parameters
from posenc.training.optim import configure_adamw

#: The model a task trains: DecoderLM, EncoderDecoder, or either (the algorithmic task).
Net = TypeVar("Net", bound=nn.Module)


class TaskModule(pl.LightningModule, Generic[Net]):
    """A LightningModule around one model of :mod:`posenc.model`: built from the
    encoder's config and the sizes of ``conf/model``, compiled in place when
    ``compile: true`` (``torch.compile`` of its forward: checkpoints keep their keys;
    ``auto`` is decided when training starts, :mod:`posenc.training.compiling`),
    trained with AdamW and the task's schedule (:attr:`optim` over :attr:`max_steps`,
    also saved by the subclass's ``save_hyperparameters``)."""

    model: Net
    n_params: int
    #: ``task.optim``: AdamW's settings and the schedule (a dict, as checkpoints keep it).
    optim: dict[str, Any]
    max_steps: int

    def build_model(
        self, net: Callable[..., Net], encoder: dict[str, Any], model: dict[str, Any], *,
        optim: dict[str, Any], max_steps: int, **kwargs: Any,
    ) -> None:  # fmt: skip
        """Set :attr:`model` to ``net(encoder=..., **kwargs, **sizes)`` and count its
        parameters; keep how it trains.

        Args:
            net: :class:`~posenc.model.DecoderLM` or :class:`~posenc.model.EncoderDecoder`.
            encoder: The encoder's Hydra config (``_target_`` + ``_partial_``).
            model: ``conf/model``: the sizes, and ``compile`` (true compiles here).
            optim: ``task.optim``.
            max_steps: The schedule's length (``trainer.max_steps``).
            kwargs: The rest of ``net``'s arguments (vocabularies, shared embeddings).
        """
        self.optim, self.max_steps = optim, max_steps
        sizes = {k: v for k, v in model.items() if k != "compile"}
        self.model = net(encoder=instantiate(encoder), **kwargs, **sizes)
        if model.get("compile") is True:  # "auto" waits for the device (AutoCompile)
            self.model.compile()
        self.n_params = count_parameters(self.model)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """The step, then every :class:`~posenc.encoders.base.Constrained` parameter set
        projected back, before anything (validation, a checkpoint) reads the values."""
        super().optimizer_step(*args, **kwargs)
        for module in self.model.modules():
            if isinstance(module, Constrained):
                module.project_()

    def configure_optimizers(self) -> Any:
        return configure_adamw(self, self.optim, self.max_steps)

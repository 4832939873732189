"""What a trainer is to the code that composes trainers
(:class:`~chemtrain.trainers.InterleaveTrainers`): the :class:`Trainer`
protocol, which every chemtrain trainer (ForceMatching, EnsembleOfModels,
Reweighting and its DiffTRe and relative-entropy forms) follows."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

#: the members of :class:`Trainer`, in the order messages name them
MEMBERS = ("params", "train", "save_checkpoint", "restore", "history", "epoch", "strategy",
           "store")


@runtime_checkable
class Trainer(Protocol):
    """A trainer that another one can hand parameters to and take turns with.

    Attributes:
      params: the current parameters; setting them hands a parameter set
        over (checked and sent from the root on every process).
      history: one record per epoch.
      epoch: epochs trained so far.
      strategy: its :mod:`chemtrain.parallel` strategy (processes, sums).
      store: its :class:`~chemtrain.trainers.checkpoints.CheckpointStore`.
    """

    params: Any
    history: list
    epoch: int
    strategy: Any
    store: Any

    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more epochs."""

    def save_checkpoint(self, path: str) -> None:
        """Write a resumable checkpoint to ``path``."""

    def restore(self, path: str) -> None:
        """Continue from a checkpoint written by :meth:`save_checkpoint`."""


def missing_members(obj) -> list[str]:
    """The members of :class:`Trainer` that ``obj`` lacks (empty: it is one)."""
    present = set(dir(obj))
    return [m for m in MEMBERS if m not in present]

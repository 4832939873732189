"""The one epoch loop of every trainer: force matching, reweighting and
fused training differ only in what one epoch does.

:func:`run_epochs` checks the checkpoint folder before the first epoch,
claims the metrics file for the run, runs the epochs under one progress bar,
writes a checkpoint every ``checkpoint_freq`` epochs and stops when the
trainer says so (early stopping), after writing the epoch it stopped at.
What an epoch computes, reports and commits to the trainer's state is the
trainer's ``one_epoch``.
"""
from __future__ import annotations

from typing import Callable


def run_epochs(trainer, max_epochs: int, checkpoint_freq: int | None,
               one_epoch: Callable, save: Callable[[], None],
               stop: Callable[[int], bool] | None = None) -> None:
    """Train ``max_epochs`` more epochs of ``trainer``.

    Args:
      trainer: has ``epoch`` (epochs done), ``store`` (its
        :class:`~chemtrain.trainers.checkpoints.CheckpointStore`) and
        ``reporter`` (its :class:`~chemtrain.trainers.report.Reporter`).
      max_epochs, checkpoint_freq: as the trainers' ``train`` takes them
        (checked by :func:`~chemtrain.trainers.report.check_epochs`).
      one_epoch: ``(epoch, epochs_bar) -> None`` trains epoch ``epoch``,
        reports it (:func:`~chemtrain.trainers.report.close_epoch`) and
        commits it: afterwards
        ``trainer.epoch == epoch + 1``.
      save: writes the checkpoint of the epochs done.
      stop: ``epoch -> bool`` after each epoch: True ends training (the
        epoch is checkpointed first when ``checkpoint_freq`` is set).
    """
    if checkpoint_freq:
        trainer.store.check_folder(trainer.epoch)
    trainer.reporter.claim(trainer.store.run_id, trainer.epoch)
    epochs = trainer.reporter.epochs(trainer.epoch, max_epochs)
    for epoch in epochs:
        one_epoch(epoch, epochs)
        stopping = stop is not None and stop(epoch)
        if checkpoint_freq and (trainer.epoch % checkpoint_freq == 0 or stopping):
            save()
        if stopping:
            break

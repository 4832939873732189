"""The files of the reweighting loop (:class:`~.reweighting.Reweighting`):
checkpoints (the trainer's state plus its trajectories), trajectory-state
files, the objective's plot and the replica check. Functions of the
trainer, which its collective methods call; the plain-data formats are
:mod:`.difftre_io`'s."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..parallel import on_root
from . import difftre_io
from .services import check_consistency


def capture(trainer, with_trajstates: bool = True) -> tuple[dict, dict]:
    """(trees, meta) of a checkpoint of ``trainer``: its state, the reuse
    rule, the state-point count, sim_batch_size and (unless
    ``with_trajstates=False``) the trajectories."""
    trees, meta = trainer.store.host(trainer.state)
    meta = dict(meta, reweight_ratio=trainer.reweight_ratio, max_reuse_se=trainer.max_reuse_se,
                max_reuses=trainer.max_reuses, n_statepoints=trainer.n_statepoints,
                sim_batch_size=trainer.sim_batch_size)
    if with_trajstates and trainer.trajstates:
        data, info = trainer.trajectories.to_host(trainer.statepoints)
        trees["trajstates"], meta["trajstates"] = data, info
    return trees, meta


def save_checkpoint(trainer, path: str) -> None:
    """Refuse a checkpoint that could not be resumed (inside ``on_update``,
    or after an epoch that did not complete), else write it."""
    if trainer._in_callback:
        raise RuntimeError(
            f"save_checkpoint was called from inside on_update: epoch {trainer.epoch} is still "
            f"running, so its state is not a resumable checkpoint. Save after train() "
            f"returns, or pass train(..., checkpoint_freq=1) to checkpoint every epoch.")
    if trainer._mid_epoch:
        stopped = trainer._stopped or ("interrupted", trainer.update_count)
        if stopped[0] == "failed":
            why = (f"update {stopped[1]} failed; the error state in {trainer.store.folder!r} "
                   f"holds the failed state for diagnosis")
        elif stopped[0] == "callback":
            why = f"on_update raised {stopped[2]} after update {stopped[1]}"
        else:
            why = f"it was interrupted after {stopped[1]} updates in all"
        raise RuntimeError(
            f"Epoch {trainer.epoch} did not complete ({why}), so a checkpoint now could not be "
            f"resumed. Restore the last epoch checkpoint, or call train() again: it goes on "
            f"from the current parameters.")
    trainer.store.save(path, *capture(trainer))


def restore(trainer, path: str, trajstates: bool = True) -> None:
    """The trainer's state from ``path``, then its trajectories."""
    state, meta = trainer.store.restore(
        path, trainer.state, {"n_shards": trainer.strategy.n_shards,
                              "n_statepoints": trainer.n_statepoints,
                              "sim_batch_size": trainer.sim_batch_size})
    trainer.state = jax.tree.map(jnp.asarray, state)  # uncommitted, as trained ones
    trainer._mid_epoch = False
    if trajstates and meta.get("trajstates"):
        trainer.load_trajstates(path)


def save_trajstates(trainer, path: str, overwrite: bool = False) -> None:
    """Write the trajectories (not over another run's file or a checkpoint
    unless ``overwrite``)."""
    if not trainer.trajstates:
        raise RuntimeError("There are no trajectory states to save; call "
                           "initialize_trajstates() first.")
    if not overwrite:
        on_root(trainer.strategy,
                lambda: difftre_io.check_replaceable(path, trainer.store.run_id), only_root=True)
    data, info = trainer.trajectories.to_host(trainer.statepoints)
    trainer.store.save(path, {"trajstates": data}, {"trajstates": info, "epoch": trainer.epoch},
                       kind="trajstates")


def plot(trainer, path: str) -> None:
    """The objective's plot, on the root process."""
    if trainer.objective.plot is None:
        raise RuntimeError(f"The objective {trainer.objective.name!r} has no plot.")
    on_root(trainer.strategy, lambda: trainer.objective.plot(
        trainer.statepoints, trainer.history, trainer.predictions, trainer.plot_x, path),
        only_root=True)


def check_replicas(trainer) -> None:
    """``TrainingError`` naming the first leaf whose replicas differ."""
    check_consistency(trainer.strategy, trainer.store.host(trainer.state)[0],
                      trainer.update_count)

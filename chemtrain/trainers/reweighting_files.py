"""The files of the reweighting loop (:class:`~.reweighting.Reweighting`):
what a checkpoint holds (the trainer's state plus its trajectories), when a
checkpoint could not be resumed, and trajectory-state files. Functions of
explicit values, which the loop's collective methods call; the plain-data
formats are :mod:`.difftre_io`'s."""
from __future__ import annotations

from ..parallel import on_root
from . import difftre_io


def capture(store, state, trajectories, statepoints, settings: dict,
            with_trajstates: bool = True) -> tuple[dict, dict]:
    """(trees, meta) of a checkpoint: ``state`` (through the
    :class:`~.checkpoints.CheckpointStore` ``store``), the loop's
    ``settings`` (reuse rule, state-point count, sim_batch_size) and,
    unless ``with_trajstates=False``, the trajectories of the
    :class:`~.trajectories.TrajectoryStore`."""
    trees, meta = store.host(state)
    meta = dict(meta, **settings)
    if with_trajstates and trajectories.states:
        data, info = trajectories.to_host(statepoints)
        trees.update(data)
        meta.update(info)
    return trees, meta


def settings(reweight_ratio, rule, trajectories, n_statepoints: int,
             sim_batch_size: int) -> dict:
    """What a checkpoint records of the loop's settings: the reuse rule, each
    state point's pool size, the state-point count and sim_batch_size."""
    return {"reweight_ratio": reweight_ratio, "max_reuse_se": rule.max_reuse_se,
            "max_reuses": rule.max_reuses,
            "pools": [trajectories.pools.get(i, 1) for i in range(n_statepoints)],
            "n_statepoints": n_statepoints, "sim_batch_size": sim_batch_size}


def adopt_pools(meta: dict, rule, trajectories) -> None:
    """A restored run keeps the pool sizes it was written with (one
    trajectory per state point for a checkpoint written before pools),
    unless the trainer's :class:`~chemtrain.learn.ReuseRule` names a pool
    size: then the resumed run equals the uninterrupted one."""
    if rule.pool is None:
        saved = meta.get("pools") or [1] * len(trajectories.pools)
        trajectories.set_pools(dict(enumerate(saved)))


def why_not_resumable(epoch: int, in_callback: bool, stopped, folder: str) -> str | None:
    """Why a checkpoint now could not be resumed, or None.

    Args:
      epoch: the epoch in progress (or next).
      in_callback: called from inside ``on_update``.
      stopped: None after a completed epoch; else why the epoch did not
        complete: ``("failed", update)``, ``("callback", update, error
        class name)`` or ``("interrupted", updates)``.
      folder: the checkpoint folder (where a failed update's error state is).
    """
    if in_callback:
        return (f"save_checkpoint was called from inside on_update: epoch {epoch} is still "
                f"running, so its state is not a resumable checkpoint. Save after train() "
                f"returns, or pass train(..., checkpoint_freq=1) to checkpoint every epoch.")
    if stopped is None:
        return None
    if stopped[0] == "failed":
        why = (f"update {stopped[1]} failed; the error state in {folder!r} holds the failed "
               f"state for diagnosis")
    elif stopped[0] == "callback":
        why = f"on_update raised {stopped[2]} after update {stopped[1]}"
    else:
        why = f"it was interrupted after {stopped[1]} updates in all"
    return (f"Epoch {epoch} did not complete ({why}), so a checkpoint now could not be "
            f"resumed. Restore the last epoch checkpoint, or call train() again: it goes on "
            f"from the current parameters.")


def save_trajstates(store, trajectories, statepoints, epoch: int, path: str,
                    overwrite: bool = False) -> None:
    """Write the trajectories (not over another run's file or a checkpoint
    unless ``overwrite``)."""
    if not trajectories.states:
        raise RuntimeError("There are no trajectory states to save; call "
                           "initialize_trajstates() first.")
    if not overwrite:
        on_root(store.strategy, lambda: difftre_io.check_replaceable(path, store.run_id),
                only_root=True)
    data, info = trajectories.to_host(statepoints)
    store.save(path, data, dict(info, epoch=epoch), kind="trajstates")

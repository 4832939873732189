"""The file methods of the DiffTRe trainers: checkpoints (trainer state
and trajectory states), trajectory-state files and the plot of predictions
against targets. Mixed into :class:`~.difftre_core._DifftreCore`, whose
attributes (``state``, ``store``, ``strategy``, ``statepoints``,
``trajstates``, ...) they use; the plain-data formats are
:mod:`.difftre_io`'s."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..parallel import on_root
from . import difftre_io
from .services import collective


class DifftreFiles:
    """Checkpoints, trajectory-state files and the plot."""

    def _capture(self, with_trajstates=True):
        trees, meta = self.store.host(self.state)
        meta = dict(meta, reweight_ratio=self.reweight_ratio, max_reuse_se=self.max_reuse_se,
                    max_reuses=self.max_reuses,
                    n_statepoints=self.n_statepoints,
                    sim_batch_size=self.sim_batch_size)
        if with_trajstates and self.trajstates:
            data, info = difftre_io.trajstates_to_host(self.trajstates, self.statepoints)
            trees["trajstates"], meta["trajstates"] = data, info
        return trees, meta

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write parameters, optimizer state, histories and the trajectory
        states to ``path`` (plain data, atomic, root process). Call it on
        every process, after a completed epoch."""
        if self._in_callback:
            raise RuntimeError(
                f"save_checkpoint was called from inside on_update: epoch {self.epoch} is still "
                f"running, so its state is not a resumable checkpoint. Save after train() "
                f"returns, or pass train(..., checkpoint_freq=1) to checkpoint every epoch.")
        if self._mid_epoch:
            stopped = self._stopped or ("interrupted", self.update_count)
            if stopped[0] == "failed":
                why = (f"update {stopped[1]} failed; the error state in {self.store.folder!r} "
                       f"holds the failed state for diagnosis")
            elif stopped[0] == "callback":
                why = f"on_update raised {stopped[2]} after update {stopped[1]}"
            else:
                why = f"it was interrupted after {stopped[1]} updates in all"
            raise RuntimeError(
                f"Epoch {self.epoch} did not complete ({why}), so a checkpoint now could not be "
                f"resumed. Restore the last epoch checkpoint, or call train() again: it goes on "
                f"from the current parameters.")
        self.store.save(path, *self._capture())

    @collective
    def restore(self, path: str, trajstates: bool = True) -> None:
        """Continue from a checkpoint of this trainer (same state points and
        sim_batch_size); also load its trajectory states unless
        ``trajstates=False``."""
        state, meta = self.store.restore(
            path, self.state, {"n_shards": self.strategy.n_shards,
                               "n_statepoints": self.n_statepoints,
                               "sim_batch_size": self.sim_batch_size})
        self.state = jax.tree.map(jnp.asarray, state)  # uncommitted, as trained ones
        self._mid_epoch = False
        if trajstates and meta.get("trajstates"):
            self.load_trajstates(path)

    @collective
    def save_trajstates(self, path: str, overwrite: bool = False) -> None:
        """Write the trajectory states (plain-data npz, root process). An
        existing file is replaced only if it holds this run's trajectory
        states, or with ``overwrite=True``."""
        if not self.trajstates:
            raise RuntimeError("There are no trajectory states to save; call "
                               "initialize_trajstates() first.")
        if not overwrite:
            on_root(self.strategy, lambda: difftre_io.check_replaceable(path, self.store.run_id),
                    only_root=True)
        data, info = difftre_io.trajstates_to_host(self.trajstates, self.statepoints)
        self.store.save(path, {"trajstates": data}, {"trajstates": info, "epoch": self.epoch},
                        kind="trajstates")

    @collective
    def load_trajstates(self, path: str) -> None:
        """Load trajectory states written by :meth:`save_trajstates` or with a
        checkpoint; training then continues exactly where they were saved."""
        meta, leaves = on_root(self.strategy, lambda: difftre_io.read(path, self.trainer_name),
                               share=False, only_root=True) or (None, None)
        meta = self.strategy.bcast_object(meta)
        leaves = self.strategy.broadcast_from_root(leaves) if self.strategy.process_count > 1 \
            else leaves
        self.trajstates.update(difftre_io.trajstates_from_host(
            self.statepoints, self.params, meta, leaves, range(self.n_statepoints), path))

    @collective
    def plot(self, path: str) -> None:
        """Plot the latest predictions against the targets of every state
        point (curves for arrays, bars for scalars) into ``path``."""
        on_root(self.strategy, lambda: difftre_io.plot(self.statepoints, self.predictions,
                                                      self.plot_x, path), only_root=True)

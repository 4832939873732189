"""The one reweighting loop (:class:`Reweighting`): DiffTRe, relative entropy
and any other :class:`~chemtrain.learn.objective.Objective` train on it.

Epochs -> batches of state points -> for each state point this process
computes (``strategy.local_items``): reuse or recompute its trajectory
(:mod:`chemtrain.learn.reuse`), the objective's loss, gradient and N_eff by
reweighting -> the objective's contributions summed over processes
(``strategy.host_sum``) -> one optax update of the mean gradient,
optionally scaled down by a :class:`~chemtrain.learn.update.StepSizeSearch`
-> the recomputed trajectories sent to every process, so each holds all of
them (parameters, optimizer state and trajectories are replicated). The
objective owns only its per-state-point numbers; reports, checkpoints and
failures come from :mod:`chemtrain.trainers.services`; the loop never asks
which parallel method runs. Random keys derive from the state point and the
update count only: stream 0 recomputed trajectories, 1 initial ones, 2 and
up the objective's ``inputs``.
"""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..compile_cache import enable as enable_compile_cache
from ..learn.reweighting import scaled_params
from ..learn.difftre_batches import as_key, statepoint_batches
from ..learn.objective import Objective
from ..learn.reuse import ReuseRule
from ..learn.statepoint import StatePoint, check_plot_x, fingerprint, make_statepoint
from ..parallel import make_strategy, on_root, raised_everywhere
from ..simulate.restart import RestartPolicy
from . import reweighting_files as files
from .checkpoints import CheckpointStore
from .options import RunOptions, run_options
from .epochs import run_epochs
from .report import Reporter, check_epochs, close_epoch
from .reweighting_update import (Loop, TimedCollectives, UpdateRefused, apply_update,
                                 check_arguments, check_optimizer_state, policies,
                                 objective_states, pool_size, reuse_rule, reuses_of)
from .services import check_consistency, collective, init_state
from .state import ReweightingState, HoldsState
from .trajectories import TrajectoryStore

log = logging.getLogger("chemtrain")


class Reweighting(HoldsState):
    """The reweighting loop: an :class:`~chemtrain.learn.objective.Objective`
    trained on state points whose trajectories are reused while they
    reweight well.

    :class:`Difftre`, :class:`DifftreParallel` and :class:`RelativeEntropy`
    are this loop with their objective and their way of adding state
    points; a new method is an objective passed here, with state points
    added by :meth:`add`. Units are chemtrain's: nm, kJ/mol, ps, amu.

    Args:
      objective: the method (:class:`~chemtrain.learn.objective.Objective`).
      key: JAX random key or integer seed (None: ``PRNGKey(0)``).
      init_params: initial parameter pytree (floating-point arrays).
      optimizer: an ``optax.GradientTransformation`` (without
        ``chemtrain.learn.ema`` or ``reduce_on_plateau``, which only force
        matching feeds: refused).
      sim_batch_size: state points per update (-1: all); a remainder joins
        the last batch; under MPI at least the number of ranks.
      parallelism: 'auto', 'single' or 'mpi'.
      reuse: the reuse rule, a :class:`~chemtrain.learn.ReuseRule` (None:
        its defaults).
      step_size_search: a :class:`~chemtrain.learn.update.StepSizeSearch`,
        True (its defaults) or None (no search).
      restart: the :class:`~chemtrain.simulate.RestartPolicy` of overflows.
      options: a :class:`~chemtrain.trainers.RunOptions`: every field but
        ``epoch_line``. Its ``name`` (default :attr:`default_name`) names
        ``<name>_error_state.npz``; ``on_update(record)`` is called after
        each applied update.

    Checkpoints and trajectory files carry the class attribute
    :attr:`trainer_name`.
    """

    trainer_name, default_name = "Reweighting", "reweighting"
    OPTIONS = ("checkpoint_path", "log_file", "plot_file", "plot_x", "progress",
               "consistency_check_every", "name", "on_update")

    def __init__(self, objective: Objective, key, init_params, optimizer, *,
                 sim_batch_size: int = 1, parallelism: str = "auto",
                 reuse: ReuseRule | None = None, step_size_search=None,
                 restart: RestartPolicy | None = None, options: RunOptions | None = None):
        check_arguments(objective, optimizer)
        enable_compile_cache()
        self.reuse = reuse_rule(reuse, objective)
        opts = self.options = run_options(options, self.trainer_name, self.OPTIONS)
        self.step_size_search, self.restart = policies(step_size_search, restart)
        statepoint_batches(max(1, sim_batch_size), sim_batch_size)  # type/range check
        self.objective = objective
        self.strategy = make_strategy(parallelism, allow_jax=False, trainer=self.trainer_name)
        ranks = self.strategy.process_count
        if sim_batch_size != -1 and sim_batch_size < ranks:
            raise ValueError(f"sim_batch_size={sim_batch_size} is smaller than the number of MPI "
                             f"ranks ({ranks}): each update splits its state points over the "
                             f"ranks, so some would have none. Use sim_batch_size >= {ranks}, "
                             f"-1 (all state points in one update), or fewer ranks.")
        self.key = jnp.asarray(as_key(key))
        self.optimizer, self.sim_batch_size = optimizer, sim_batch_size
        self.reweight_ratio = self.reuse.reweight_ratio
        self.plot_file, self.plot_x = opts.plot_file, dict(opts.plot_x or {})
        self.consistency_check_every = opts.consistency_check_every
        self.name, self.on_update = opts.name or self.default_name, opts.on_update
        self.reporter = Reporter(self.strategy, opts.log_file, opts.progress)
        # nothing placed: whole state points per process on its default device,
        # uncommitted arrays (compiled functions reused whatever made the inputs)
        self.store = CheckpointStore(self.strategy, opts.checkpoint_path or "checkpoints",
                                     self.trainer_name, replicated=())
        _, opt_state, host_params = init_state(self.strategy, init_params, optimizer)
        opt_state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), opt_state)  # the root's
        check_optimizer_state(opt_state, self.trainer_name)
        self.state = ReweightingState(jax.tree.map(jnp.asarray, host_params), opt_state)
        self.statepoints: list[StatePoint] = []
        self.trajectories = TrajectoryStore(self.strategy, self.restart)
        self.predictions: dict[int, dict] = {}
        self.comm = TimedCollectives(self.strategy)
        self._in_callback = False
        self._apply = jax.jit(scaled_params)
        self._opt_update = jax.jit(optimizer.update)

    # -- state ------------------------------------------------------------------
    n_statepoints = property(lambda self: len(self.statepoints))
    trajstates = property(lambda self: self.trajectories.states,
                          doc="State point -> its trajectory states, one per chain.")
    opt_state = property(lambda self: self.state.opt_state)
    epoch = property(lambda self: self.state.epoch)
    update_count = property(lambda self: self.state.update_count)
    init_runs = property(lambda self: self.state.init_runs)
    history = property(lambda self: self.state.history)
    epoch_losses = property(lambda self: self.state.epoch_losses)
    update_losses = property(lambda self: self.state.update_losses)
    max_reuse_se = property(lambda self: self.reuse.max_reuse_se)
    max_reuses = property(lambda self: self.reuse.max_reuses)

    @collective
    def add(self, fns, state_kwargs, reference, targets=None, target_values=None,
            n_snapshots: int = 0, name: str | None = None, data=None, spec=None,
            like: StatePoint | None = None) -> StatePoint:
        """Add a state point (:func:`~chemtrain.learn.make_statepoint`, next
        index; sampled by :meth:`initialize_trajstates`) and return it.
        ``spec``: the objective's settings, from which it prepares its
        functions (:attr:`~chemtrain.learn.Objective.prepare`); ``like``: an
        earlier state point of the same ``fns`` whose prepared functions it
        shares instead (nothing compiled again)."""
        sp = self._append(fns, state_kwargs, reference, targets, target_values, n_snapshots,
                          name, data, spec, like)
        self._check_statepoints(f"add_statepoint of state point {sp.index}")
        return sp

    def _append(self, fns, state_kwargs, reference, targets, target_values, n_snapshots,
                name=None, data=None, spec=None, like=None) -> StatePoint:
        if like is not None and like.fns is not fns:
            raise ValueError(f"like=state point {like.name} shares its prepared functions only "
                             f"with state points of its own simulation functions (fns).")
        functions = like.functions if like is not None else self.objective.prepare(fns, spec)
        sp = make_statepoint(len(self.statepoints), fns, state_kwargs, reference, targets or {},
                             target_values or {}, n_snapshots, name, data, functions)
        check_plot_x(self.plot_x, sp)
        self.statepoints.append(sp)
        self.trajectories.pools[sp.index] = pool_size(self.reuse, self.objective, sp)
        self.state = self.state.replace(
            reuses=reuses_of(self.state, self.n_statepoints),
            objective_state=objective_states(self.state, self.objective, self.statepoints,
                                             self.params))
        return sp

    def batches(self) -> list[list[int]]:
        """The state points of each update of an epoch. Its errors depend only
        on values every process checked to agree, so they are raised on all."""
        try:
            batches = statepoint_batches(self.n_statepoints, self.sim_batch_size)
        except ValueError as e:
            raise raised_everywhere(e) from None
        ranks = self.strategy.process_count
        if min(len(b) for b in batches) < ranks:
            raise raised_everywhere(ValueError(
                f"Each update splits its state points over the {ranks} MPI ranks, but there are "
                f"only {self.n_statepoints} state point(s) (sim_batch_size={self.sim_batch_size}): "
                f"some ranks would have none. Use at most {self.n_statepoints} rank(s) or add "
                f"state points."))
        return batches

    def _check_statepoints(self, what: str) -> None:
        """Fail on every process unless all were given the same state points
        (count, shapes, checksums of state_kwargs, reference states, targets
        and data) and sim_batch_size; ``what`` names the operation."""
        shapes, crc = fingerprint(self.statepoints)
        self.strategy.check_same({"n_statepoints": self.n_statepoints, "shapes": shapes,
                                  "checksum": crc, "sim_batch_size": self.sim_batch_size,
                                  "at": what},
                                 f"the state points ({what}: their number, shapes and a checksum "
                                 f"of state_kwargs, reference states and targets)")

    def _check(self, sp, trajs) -> None:
        self.objective.check(sp, self.params, trajs)

    def _loop(self) -> Loop:
        return Loop(self.objective, tuple(self.statepoints), self.trajectories, self.comm,
                    self.key, (self.reweight_ratio, self.reuse),
                    self.step_size_search, self._opt_update, self._apply)

    # -- sampling ---------------------------------------------------------------
    @collective
    def initialize_trajstates(self, num_runs: int = 1, statepoints=None) -> None:
        """Sample the first trajectory of every state point (or of the given
        ``statepoints``) from its reference state: ``num_runs`` trajectories
        in a row, of which all but the last serve as equilibration. Each
        state point is checked on its first configuration (the objective's
        ``check``)."""
        if not self.statepoints:
            raise ValueError("There are no state points; add them first.")
        if not (isinstance(num_runs, int) and num_runs >= 1):
            raise ValueError(f"num_runs must be a positive integer, got {num_runs!r}.")
        self._check_statepoints("initialize_trajstates")
        base = jax.random.fold_in(self.key, 1)
        chosen = [i for i in range(self.n_statepoints) if statepoints is None or i in statepoints]
        mine = self._loop().local(chosen)

        def compute():
            bar = self.reporter.bar(len(mine) * num_runs, "initial trajectories")
            new = {i: self.trajectories.initial(self.statepoints[i], self.params, base, num_runs,
                                                self._check, bar) for i in mine}
            bar.close()
            return new

        new = self.comm.agree(compute, "sampling initial trajectories")
        self.trajectories.replace(self.comm.timed(self.trajectories.exchange,
                                                  self.statepoints, self.params, new))
        reuses = reuses_of(self.state, self.n_statepoints)
        for i in chosen:
            reuses[i] = 0   # a fresh trajectory
        self.state = self.state.replace(init_runs=num_runs, reuses=reuses)

    # -- training ---------------------------------------------------------------
    @collective
    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more epochs; every state point is used once per
        epoch. Checkpoint every ``checkpoint_freq`` epochs; write the plot
        into ``plot_file`` at the end if it was given."""
        check_epochs(max_epochs, checkpoint_freq)
        self._check_statepoints("train")
        missing = [i for i in range(self.n_statepoints) if i not in self.trajstates]
        if missing:
            raise RuntimeError(f"State point(s) {missing} have no trajectory yet: call "
                               f"trainer.initialize_trajstates() (or load_trajstates(path)) "
                               f"before train().")
        batches = self.batches()
        run_epochs(self, max_epochs, checkpoint_freq,
                   lambda epoch, bar: self._epoch(batches, epoch, bar),
                   lambda: self.store.save_epoch(self.epoch, *self._capture()))
        if self.plot_file:
            self.plot(self.plot_file)

    def _epoch(self, batches, epoch: int, epochs_bar) -> None:
        """Train, report and commit one epoch of updates."""
        started = time.perf_counter()
        self.comm.reset()
        self._stop("interrupted", self.update_count)
        bar = self.reporter.bar(len(batches), f"epoch {epoch}")
        per_sp, step_sizes, norms = {}, [], []
        for batch in batches:
            result = self._update(batch, epoch)
            per_sp.update(result["statepoints"])
            step_sizes.append(result["step_size"])
            norms.append(result["grad_norm"])
            bar.set_postfix(loss=f"{result['loss']:.4g}")
            bar.update()
        bar.close()
        self.state = self.state.replace(stopped=None)
        loss = float(np.mean([per_sp[i]["loss"] for i in sorted(per_sp)]))
        record = {"epoch": epoch, "update": self.update_count, "loss": loss,
                  "step_sizes": step_sizes, "grad_norms": norms,
                  "statepoints": [per_sp[i] for i in sorted(per_sp)]}
        n_re = sum(r["recomputed"] for r in record["statepoints"])
        text = (f"epoch {epoch}: loss {loss:.5g}, {n_re} of {len(per_sp)} state point(s) "
                f"recomputed, min N_eff {min(r['n_eff'] for r in record['statepoints']):.1f}")
        record["comm_s"] = self.strategy.host_max(self.comm.comm_s)
        record["wait_s"] = self.strategy.host_max(self.comm.wait_s)
        close_epoch(self.strategy, self.reporter, record, text, epochs_bar, started,
                    loss=f"{loss:.4g}")
        self.state = self.state.replace(epoch=epoch + 1,
                                        epoch_losses=[*self.state.epoch_losses, loss],
                                        history=[*self.state.history, record])

    def _update(self, batch, epoch):
        try:
            state, report, predictions, new = apply_update(self._loop(), self.state, batch,
                                                           epoch)
        except UpdateRefused as e:
            self._stop("failed", self.update_count)
            trees, meta = self._capture(with_trajstates=False)
            self.store.fail(str(e), trees, dict(meta, failed_epoch=epoch),
                            name=f"{self.name}_error_state")
        self.trajectories.put(new, report.pop("derived"))
        self.state, before = state, report.pop("params_before")
        self._stop("interrupted", self.update_count)
        self.predictions.update(predictions)
        every = self.consistency_check_every
        if every and self.update_count % every == 0:
            self.check_consistency()
        if self.on_update is not None:
            self._call_on_update({"update": self.update_count - 1, "epoch": epoch,
                                  "batch": list(batch), "params_before": before,
                                  "params_after": state.params, "loss": report["loss"],
                                  "step_size": report["step_size"],
                                  "statepoints": report["statepoints"]})
        return report

    def _stop(self, *why) -> None:
        """Record in the state why the running epoch has not completed."""
        self.state = self.state.replace(stopped=list(why))

    def _call_on_update(self, record) -> None:
        self._in_callback = True
        try:
            self.on_update(record)
        except Exception as e:
            self._stop("callback", record["update"], type(e).__name__)
            e.add_note(f"(raised by on_update after update {record['update']}, which was "
                       f"applied)")
            raise
        finally:
            self._in_callback = False

    def _capture(self, with_trajstates: bool = True):
        return files.capture(self.store, self.state, self.trajectories, self.statepoints,
                             files.settings(self.reweight_ratio, self.reuse, self.trajectories,
                                            self.n_statepoints, self.sim_batch_size),
                             with_trajstates)

    # -- files (chemtrain.trainers.reweighting_files) -------------------------
    @collective
    def check_consistency(self) -> None:
        """Raise ``TrainingError`` naming the first leaf of parameters or
        optimizer state whose replicas differ between processes."""
        check_consistency(self.strategy, self.store.host(self.state)[0], self.update_count)

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write parameters, optimizer state, histories and the trajectory
        states to ``path`` (plain data, atomic, root process). Call it on
        every process, after a completed epoch."""
        problem = files.why_not_resumable(self.epoch, self._in_callback, self.state.stopped,
                                          self.store.folder)
        if problem:
            raise RuntimeError(problem)
        self.store.save(path, *self._capture())

    @collective
    def restore(self, path: str, trajstates: bool = True) -> None:
        """Continue from a checkpoint of this trainer (same state points and
        sim_batch_size); also load its trajectory states unless
        ``trajstates=False``."""
        state, meta = self.store.restore(
            path, self.state, {"n_statepoints": self.n_statepoints,
                               "sim_batch_size": self.sim_batch_size})
        state = jax.tree.map(jnp.asarray, state)  # uncommitted, as trained ones
        self.state = state.replace(stopped=None, objective_state=objective_states(
            state, self.objective, self.statepoints, state.params))
        files.adopt_pools(meta, self.reuse, self.trajectories)
        if trajstates and meta.get("trajstates"):
            self.load_trajstates(path)

    @collective
    def save_trajstates(self, path: str, overwrite: bool = False) -> None:
        """Write the trajectory states (plain-data npz, root process). An
        existing file is replaced only if it holds this run's trajectory
        states, or with ``overwrite=True``."""
        files.save_trajstates(self.store, self.trajectories, self.statepoints, self.epoch, path,
                              overwrite)

    @collective
    def load_trajstates(self, path: str) -> None:
        """Load trajectory states written by :meth:`save_trajstates` or with a
        checkpoint, each state point checked on its first configuration;
        training then continues exactly where they were saved."""
        loaded, older = self.trajectories.read(self.statepoints, self.params, path,
                                               self.trainer_name)
        for i, trajs in loaded.items():
            self._check(self.statepoints[i], trajs)
        self.trajectories.replace(loaded, older)

    @collective
    def plot(self, path: str) -> None:
        """Write the objective's plot (DiffTRe: predictions against targets
        per state point; relative entropy: its change, the gradient norm and
        N_eff / N per update) into ``path``."""
        if self.objective.plot is None:
            raise RuntimeError(f"The objective {self.objective.name!r} has no plot.")
        on_root(self.strategy, lambda: self.objective.plot(
            self.statepoints, self.history, self.predictions, self.plot_x, path), only_root=True)

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
import optax

from ..learn.difftre import scaled_params
from ..learn.difftre_batches import as_key, statepoint_batches
from ..learn.objective import Objective
from ..learn.reuse import check_reuse
from ..learn.statepoint import StatePoint, check_plot_x, fingerprint, make_statepoint
from ..learn.update import StepSizeSearch
from ..parallel import agree, make_strategy, raised_everywhere
from ..simulate.restart import RestartPolicy
from . import reweighting_files as files
from .checkpoints import CheckpointStore
from .report import Reporter, check_epochs, close_epoch
from .reweighting_update import apply_update
from .services import collective, init_state
from .state import DifftreState, HoldsState
from .trajectories import TrajectoryStore

log = logging.getLogger("chemtrain")


def _policy(step_size_search, restart):
    if step_size_search is True:
        step_size_search = StepSizeSearch()
    if step_size_search is False:
        step_size_search = None
    if step_size_search is not None and not isinstance(step_size_search, StepSizeSearch):
        raise TypeError(f"step_size_search must be a chemtrain.learn.StepSizeSearch(candidates, "
                        f"allowed_reduction), True (its defaults) or None, got "
                        f"{type(step_size_search).__name__}.")
    restart = RestartPolicy() if restart is None else restart
    if not isinstance(restart, RestartPolicy):
        raise TypeError(f"restart must be a chemtrain.simulate.RestartPolicy(capacity_multiplier, "
                        f"max_retries) or None, got {type(restart).__name__}.")
    return step_size_search, restart


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
      optimizer: an ``optax.GradientTransformation``.
      trainer_name: the name checkpoints and trajectory files carry.
      state_class: the :class:`~chemtrain.trainers.DifftreState` class (or
        a subclass with a list field per key of ``objective.numbers``).
      sim_batch_size: state points per update (-1: all); a remainder joins
        the last batch; under MPI at least the number of ranks.
      parallelism: 'auto', 'single' or 'mpi'.
      reweight_ratio: recompute a trajectory when N_eff < ratio x N.
      max_reuse_se: recompute once the parameters moved more than this many
        standard errors of the trajectory's own estimate (None: no limit).
      max_reuses: recompute after this many reuses (None: no limit).
      step_size_search: a :class:`~chemtrain.learn.update.StepSizeSearch`,
        True (its defaults) or None (no search).
      restart: the :class:`~chemtrain.simulate.RestartPolicy` of
        neighbor-list overflows (None: its defaults).
      checkpoint_path: folder of checkpoints and ``<name>_error_state.npz``.
      log_file: JSON-lines metrics file, one line per epoch (None: none).
      plot_file: where :meth:`train` writes the objective's plot at its end.
      plot_x: ``{target name: x values}`` of array observables' plots.
      progress: show progress bars (root process, on a terminal).
      consistency_check_every: check every this many updates that the
        replicas agree (None: never).
      name: the run's name, in ``<name>_error_state.npz``.
      on_update: optional ``fn(record)`` called after each applied update.
    """

    def __init__(self, objective: Objective, key, init_params, optimizer, *,
                 trainer_name: str = "Reweighting", state_class=DifftreState,
                 sim_batch_size: int = 1, parallelism: str = "auto",
                 reweight_ratio: float = 0.9, max_reuse_se: float | None = 0.2,
                 max_reuses: int | None = 4, step_size_search=None,
                 restart: RestartPolicy | None = None, checkpoint_path: str = "checkpoints",
                 log_file: str | None = None, plot_file: str | None = None, plot_x=None,
                 progress: bool = True, consistency_check_every: int | None = None,
                 name: str = "reweighting", on_update=None):
        if not isinstance(objective, Objective):
            raise TypeError(f"objective must be a chemtrain.learn.Objective, got "
                            f"{type(objective).__name__}.")
        missing = [k for k in objective.numbers if not hasattr(state_class, "__dataclass_fields__")
                   or k not in state_class.__dataclass_fields__]
        if missing:
            raise TypeError(f"state_class {state_class.__name__} has no field {missing} for the "
                            f"objective's numbers.")
        check_reuse(reweight_ratio, max_reuse_se, max_reuses)
        self.step_size_search, self.restart = _policy(step_size_search, restart)
        if on_update is not None and not callable(on_update):
            raise TypeError(f"on_update must be a function of one record (a dict), got "
                            f"{type(on_update).__name__}.")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got "
                            f"{type(optimizer).__name__}.")
        statepoint_batches(max(1, sim_batch_size), sim_batch_size)  # type/range check
        self.objective, self.trainer_name, self.state_class = objective, trainer_name, state_class
        self.strategy = make_strategy(parallelism, allow_jax=False, trainer=trainer_name)
        ranks = self.strategy.process_count
        if sim_batch_size != -1 and sim_batch_size < ranks:
            raise ValueError(f"sim_batch_size={sim_batch_size} is smaller than the number of MPI "
                             f"ranks ({ranks}): each update splits its state points over the "
                             f"ranks, so some would have none. Use sim_batch_size >= {ranks}, "
                             f"-1 (all state points in one update), or fewer ranks.")
        self.key = jnp.asarray(as_key(key))
        self.optimizer, self.sim_batch_size = optimizer, sim_batch_size
        self.reweight_ratio = float(reweight_ratio)
        self.max_reuse_se = None if max_reuse_se is None else float(max_reuse_se)
        self.max_reuses = None if max_reuses is None else int(max_reuses)
        self.plot_file, self.plot_x = plot_file, dict(plot_x or {})
        self.consistency_check_every, self.name, self.on_update = (consistency_check_every,
                                                                  name, on_update)
        self.reporter = Reporter(self.strategy, log_file, progress)
        # nothing is placed: every process computes whole state points on its
        # default device, with uncommitted arrays (so compiled functions are
        # reused whatever produced their inputs)
        self.store = CheckpointStore(self.strategy, checkpoint_path, trainer_name, replicated=())
        _, _, host_params = init_state(self.strategy, init_params, optimizer)
        params = jax.tree.map(jnp.asarray, host_params)
        opt_state = self.strategy.broadcast_from_root(jax.tree.map(np.asarray,
                                                                   optimizer.init(params)))
        self.state = state_class(params, jax.tree.map(jnp.asarray, opt_state))
        self.statepoints: list[StatePoint] = []
        self.trajectories = TrajectoryStore(self.strategy, self.restart)
        self.predictions: dict[int, dict] = {}
        self._comm_s = self._wait_s = 0.0  # this epoch: exchanges, waiting for others
        self._mid_epoch = False  # an update of an epoch failed: no resumable checkpoint
        self._stopped = None     # why the epoch stopped: ("failed"|"callback", update, ...)
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

    @collective
    def add(self, fns, state_kwargs, reference, targets=None, target_values=None,
            n_snapshots: int = 0, name: str | None = None, data=None) -> StatePoint:
        """Add a state point (:func:`chemtrain.learn.statepoint.make_statepoint`
        with the next index): ``fns`` its
        :class:`~chemtrain.learn.statepoint.SimulationFunctions` with the
        objective's ``method``, ``reference`` positions (N, dim) or (chains,
        N, dim), ``targets``/``target_values`` as in :class:`DifftreParallel`
        (none for relative entropy), ``n_snapshots`` per chain, ``data``
        what the objective learns from besides targets. Its trajectory is
        sampled by :meth:`initialize_trajstates`. Returns the state point."""
        sp = self._append(fns, state_kwargs, reference, targets, target_values, n_snapshots,
                          name, data)
        self._check_statepoints(f"add_statepoint of state point {sp.index}")
        return sp

    def _append(self, fns, state_kwargs, reference, targets, target_values, n_snapshots,
                name=None, data=None) -> StatePoint:
        sp = make_statepoint(len(self.statepoints), fns, state_kwargs, reference, targets or {},
                             target_values or {}, n_snapshots, name, data)
        check_plot_x(self.plot_x, sp)
        self.statepoints.append(sp)
        n = self.n_statepoints
        grown = {k: [*getattr(self.state, k), *[v] * (n - len(getattr(self.state, k)))]
                 for k, v in self.objective.numbers.items()}
        self.state = self.state.replace(reuses=self._reuses(), **grown)
        return sp

    def _reuses(self) -> list:
        """Per state point, the updates that reused its trajectory since it
        was sampled (0 where a checkpoint of an older version had none)."""
        known = list(self.state.reuses)
        return [int(c) for c in known[:self.n_statepoints]] + \
            [0] * max(0, self.n_statepoints - len(known))

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

    def _local(self, batch):
        return [batch[j] for j in self.strategy.local_items(len(batch))]

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

    def _exchange(self, new: dict) -> dict:
        started = time.perf_counter()
        out = self.trajectories.exchange(self.statepoints, self.params, new)
        self._comm_s += time.perf_counter() - started
        return out

    def _agree(self, compute, what):
        """:func:`agree` on ``compute``, timing the wait for the others."""
        done = []

        def timed():
            result = jax.block_until_ready(compute())  # time the work, not its dispatch
            done.append(time.perf_counter())
            return result
        result = agree(self.strategy, timed, what)
        self._wait_s += time.perf_counter() - done[0]
        return result

    def _check(self, sp, trajs) -> None:
        self.objective.check(sp, self.params, trajs)

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
        mine = self._local(chosen)

        def compute():
            bar = self.reporter.bar(len(mine) * num_runs, "initial trajectories")
            new = {i: self.trajectories.initial(self.statepoints[i], self.params, base, num_runs,
                                                self._check, bar) for i in mine}
            bar.close()
            return new

        self.trajectories.put(self._exchange(self._agree(compute,
                                                         "sampling initial trajectories")))
        reuses = self._reuses()
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
        if checkpoint_freq:
            self.store.check_folder(self.epoch)
        self.reporter.claim(self.store.run_id)
        batches = self.batches()
        epochs = self.reporter.epochs(self.epoch, max_epochs)
        for epoch in epochs:
            started, self._comm_s, self._wait_s = time.perf_counter(), 0.0, 0.0
            self._mid_epoch, self._stopped = True, None
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
            self._mid_epoch = False
            loss = float(np.mean([per_sp[i]["loss"] for i in sorted(per_sp)]))
            record = {"epoch": epoch, "update": self.update_count, "loss": loss,
                      "step_sizes": step_sizes, "grad_norms": norms,
                      "statepoints": [per_sp[i] for i in sorted(per_sp)]}
            n_re = sum(r["recomputed"] for r in record["statepoints"])
            text = (f"epoch {epoch}: loss {loss:.5g}, {n_re} of {len(per_sp)} state point(s) "
                    f"recomputed, min N_eff {min(r['n_eff'] for r in record['statepoints']):.1f}")
            record["comm_s"] = self.strategy.host_max(self._comm_s)
            record["wait_s"] = self.strategy.host_max(self._wait_s)
            close_epoch(self.strategy, self.reporter, record, text, epochs, started,
                        loss=f"{loss:.4g}")
            self.state = self.state.replace(epoch=epoch + 1,
                                            epoch_losses=[*self.state.epoch_losses, loss],
                                            history=[*self.state.history, record])
            if checkpoint_freq and self.epoch % checkpoint_freq == 0:
                self.store.save_epoch(self.epoch, *files.capture(self))
        if self.plot_file:
            self.plot(self.plot_file)

    def _update(self, batch, epoch):
        return apply_update(self, batch, epoch)

    def _fail(self, message, epoch):
        self._stopped = ("failed", self.update_count)
        trees, meta = files.capture(self, with_trajstates=False)
        self.store.fail(message, trees, dict(meta, failed_epoch=epoch),
                        name=f"{self.name}_error_state")

    # -- files (chemtrain.trainers.reweighting_files) -------------------------
    @collective
    def check_consistency(self) -> None:
        """Raise ``TrainingError`` naming the first leaf of parameters or
        optimizer state whose replicas differ between processes."""
        files.check_replicas(self)

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write parameters, optimizer state, histories and the trajectory
        states to ``path`` (plain data, atomic, root process). Call it on
        every process, after a completed epoch."""
        files.save_checkpoint(self, path)

    @collective
    def restore(self, path: str, trajstates: bool = True) -> None:
        """Continue from a checkpoint of this trainer (same state points and
        sim_batch_size); also load its trajectory states unless
        ``trajstates=False``."""
        files.restore(self, path, trajstates)

    @collective
    def save_trajstates(self, path: str, overwrite: bool = False) -> None:
        """Write the trajectory states (plain-data npz, root process). An
        existing file is replaced only if it holds this run's trajectory
        states, or with ``overwrite=True``."""
        files.save_trajstates(self, path, overwrite)

    @collective
    def load_trajstates(self, path: str) -> None:
        """Load trajectory states written by :meth:`save_trajstates` or with a
        checkpoint, each state point checked on its first configuration;
        training then continues exactly where they were saved."""
        loaded = self.trajectories.read(self.statepoints, self.params, path, self.trainer_name)
        for i, trajs in loaded.items():
            self._check(self.statepoints[i], trajs)
        self.trajectories.put(loaded)

    @collective
    def plot(self, path: str) -> None:
        """Write the objective's plot (DiffTRe: predictions against targets
        per state point; relative entropy: its change, the gradient norm and
        N_eff / N per update) into ``path``."""
        files.plot(self, path)

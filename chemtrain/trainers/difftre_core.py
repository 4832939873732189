"""The DiffTRe training loop shared by ``DifftreParallel`` and ``Difftre``.

A thin loop: epochs -> batches of state points -> for each state point this
process computes (``strategy.local_items``): reuse or recompute its
trajectory, the loss and gradient by reweighting -> gradients summed over
processes (``strategy.host_sum``) and divided by the batch size -> one optax
update, optionally scaled down so N_eff keeps ``allowed_reduction`` of its
value -> the recomputed trajectories sent to every process, so each holds
all of them (parameters, optimizer state and trajectories are replicated).
The numbers come from :mod:`chemtrain.learn.difftre`, trajectories from
:mod:`chemtrain.simulate.trajectory`, reports, checkpoints and failures from
:mod:`chemtrain.trainers.services`; the loop never asks which parallel
method runs. Random keys derive from the state point and the update count
only.
"""
from __future__ import annotations

import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..learn import difftre as dt
from ..learn import difftre_update as du
from ..learn.diagnose import all_finite
from ..parallel import agree, make_strategy, raised_everywhere
from ..simulate.trajectory import NeighborListOverflowError, SimulationError
from . import difftre_io
from .difftre_files import DifftreFiles
from .difftre_sampling import DifftreSampling
from .report import Reporter, check_epochs, close_epoch
from .services import CheckpointStore, check_consistency, collective, init_state
from .state import DifftreState, HoldsState
from .statepoint import StatePoint, check_plot_x, fingerprint, make_statepoint

log = logging.getLogger("chemtrain")


class _DifftreCore(HoldsState, DifftreSampling, DifftreFiles):
    """The training loop shared by :class:`DifftreParallel` and
    :class:`Difftre`, and their one constructor path: both pass their
    training options (documented in :class:`DifftreParallel`) on to this
    ``__init__``, which checks them and builds the services."""

    trainer_name = "Difftre"
    state_class = DifftreState

    def __init__(self, key, init_params, optimizer, *, sim_batch_size: int = 1,
                 parallelism: str = "auto", reweight_ratio: float = 0.9,
                 max_reuse_se: float | None = 0.2, max_reuses: int | None = 4,
                 step_size_search: bool = False, allowed_reduction: float = 0.5,
                 n_step_candidates: int = 10, overflow_capacity_multiplier: float = 1.5,
                 max_neighbor_retries: int = 3, checkpoint_path: str = "checkpoints",
                 log_file: str | None = None, plot_file: str | None = None,
                 plot_x=None, progress: bool = True, consistency_check_every: int | None = None,
                 name: str = "difftre", on_update=None):
        if not (isinstance(reweight_ratio, (int, float)) and 0.0 <= reweight_ratio <= 1.0):
            raise ValueError(f"reweight_ratio must be a number in [0, 1] (recompute when "
                             f"N_eff < reweight_ratio * N), got {reweight_ratio!r}.")
        if max_reuse_se is not None and not (
                isinstance(max_reuse_se, (int, float)) and not isinstance(max_reuse_se, bool)
                and 0.0 < max_reuse_se < math.inf):
            raise ValueError(f"max_reuse_se must be a positive number (recompute once the "
                             f"parameters moved that many standard errors of the trajectory's "
                             f"own estimate) or None (only the reweight_ratio rule), got "
                             f"{max_reuse_se!r}.")
        if max_reuses is not None and (isinstance(max_reuses, bool) or not isinstance(
                max_reuses, (int, np.integer)) or max_reuses < 0):
            raise ValueError(f"max_reuses must be a whole number >= 0 (updates a trajectory may "
                             f"serve after the one it was sampled for; 0 recomputes every update) "
                             f"or None (no limit), got {max_reuses!r}.")
        if not 0.0 < allowed_reduction <= 1.0:
            raise ValueError(f"allowed_reduction must be in (0, 1], got {allowed_reduction!r}.")
        if on_update is not None and not callable(on_update):
            raise TypeError(f"on_update must be a function of one record (a dict), got "
                            f"{type(on_update).__name__}.")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got "
                            f"{type(optimizer).__name__}.")
        dt.statepoint_batches(max(1, sim_batch_size), sim_batch_size)  # type/range check
        self.strategy = make_strategy(parallelism, allow_jax=False, trainer=self.trainer_name)
        ranks = self.strategy.process_count
        if sim_batch_size != -1 and sim_batch_size < ranks:
            raise ValueError(f"sim_batch_size={sim_batch_size} is smaller than the number of MPI "
                             f"ranks ({ranks}): each update splits its state points over the "
                             f"ranks, so some would have none. Use sim_batch_size >= {ranks}, "
                             f"-1 (all state points in one update), or fewer ranks.")
        key = dt.as_key(key)
        self.key = jnp.asarray(key)
        self.optimizer = optimizer
        self.sim_batch_size = sim_batch_size
        self.reweight_ratio = float(reweight_ratio)
        self.max_reuse_se = None if max_reuse_se is None else float(max_reuse_se)
        self.max_reuses = None if max_reuses is None else int(max_reuses)
        self.step_size_search = bool(step_size_search)
        self.allowed_reduction = float(allowed_reduction)
        self.step_candidates = dt.step_size_candidates(n_step_candidates)
        self.overflow_capacity_multiplier = overflow_capacity_multiplier
        self.max_neighbor_retries = max_neighbor_retries
        self.plot_file, self.plot_x = plot_file, dict(plot_x or {})
        self.consistency_check_every = consistency_check_every
        self.name = name
        self.on_update = on_update
        self.reporter = Reporter(self.strategy, log_file, progress)
        # DiffTRe places nothing: every process computes whole state points on its
        # default device, with uncommitted arrays (so compiled functions are
        # reused whatever produced their inputs)
        self.store = CheckpointStore(self.strategy, checkpoint_path, self.trainer_name,
                                     replicated=())
        _, _, host_params = init_state(self.strategy, init_params, optimizer)
        params = jax.tree.map(jnp.asarray, host_params)
        self.state = self.state_class(params, jax.tree.map(jnp.asarray, self.strategy.broadcast_from_root(
            jax.tree.map(np.asarray, optimizer.init(params)))))
        self.statepoints: list[StatePoint] = []
        self.trajstates: dict[int, list] = {}
        self.predictions: dict[int, dict] = {}
        self._fixed_cache: dict[int, tuple] = {}  # state point -> (trajs, fixed quantities)
        self._templates: dict = {}  # trajectory-state structures (see difftre_io.unpack)
        self._comm_s = self._wait_s = 0.0  # this epoch: exchanges, waiting for others
        self._mid_epoch = False  # an update of an epoch failed: no resumable checkpoint
        self._stopped = None     # why the epoch stopped: ("failed"|"callback", update, ...)
        self._in_callback = False
        self._apply = jax.jit(lambda p, u, a: dt.scaled_params(p, u, a))
        self._opt_update = jax.jit(optimizer.update)

    @property
    def n_statepoints(self) -> int:
        return len(self.statepoints)

    # -- state ------------------------------------------------------------------
    opt_state = property(lambda self: self.state.opt_state)
    epoch = property(lambda self: self.state.epoch)
    update_count = property(lambda self: self.state.update_count)
    init_runs = property(lambda self: self.state.init_runs)
    history = property(lambda self: self.state.history)
    epoch_losses = property(lambda self: self.state.epoch_losses)
    update_losses = property(lambda self: self.state.update_losses)

    # -- building state points ----------------------------------------------
    def _add(self, fns, state_kwargs, reference, targets, target_values, n_snapshots, name=None,
             data=None):
        sp = make_statepoint(len(self.statepoints), fns, state_kwargs, reference, targets,
                             target_values, n_snapshots, name, data)
        check_plot_x(self.plot_x, sp)
        self.statepoints.append(sp)
        self.state = self.state.replace(reuses=self._reuses())
        return sp

    def _reuses(self) -> list:
        """Per state point, the updates that have reused its trajectory since
        it was sampled (a fresh list; 0 where a checkpoint of an older
        version had no count)."""
        known = list(self.state.reuses)
        return [int(c) for c in known[:self.n_statepoints]] + \
            [0] * max(0, self.n_statepoints - len(known))

    # -- which state points this process computes -----------------------------
    def batches(self) -> list[list[int]]:
        """The state points of each update of an epoch. Its errors depend only
        on values every process checked to agree, so they are raised on all."""
        try:
            batches = dt.statepoint_batches(self.n_statepoints, self.sim_batch_size)
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
        (count, shapes, checksums of state_kwargs, reference states and
        targets) and sim_batch_size; ``what`` names the operation."""
        shapes, crc = fingerprint(self.statepoints)
        self.strategy.check_same({"n_statepoints": self.n_statepoints, "shapes": shapes,
                                  "checksum": crc, "sim_batch_size": self.sim_batch_size,
                                  "at": what},
                                 f"the state points ({what}: their number, shapes and a checksum "
                                 f"of state_kwargs, reference states and targets)")

    def _exchange(self, new: dict) -> dict:
        """Every process's newly computed trajectory states, on every process."""
        if self.strategy.process_count == 1:
            return new
        started = time.perf_counter()
        parts = self.strategy.host_allgather_object(difftre_io.pack(new))
        theirs = {i: chains for part in parts for i, chains in part.items() if i not in new}
        out = difftre_io.unpack(self.statepoints, self.params, theirs, self._templates)
        out.update(new)
        self._comm_s += time.perf_counter() - started
        return out

    def _agree(self, compute, what):
        """:func:`agree` on ``compute``, timing the wait for the other
        processes."""
        done = []

        def timed():
            result = jax.block_until_ready(compute())  # time the work, not its dispatch
            done.append(time.perf_counter())
            return result
        result = agree(self.strategy, timed, what)
        self._wait_s += time.perf_counter() - done[0]
        return result

    def _train_key(self, index, chain):
        return dt.statepoint_key(jax.random.fold_in(self.key, 0), index, self.update_count, chain)

    # -- training ---------------------------------------------------------------
    @collective
    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more epochs; every state point is used once per
        epoch. Checkpoint every ``checkpoint_freq`` epochs; write the plot of
        predictions against targets at the end if ``plot_file`` was given."""
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
                self.store.save_epoch(self.epoch, *self._capture())
        if self.plot_file:
            self.plot(self.plot_file)

    def _update(self, batch, epoch):
        """One update over the state points ``batch``: each process computes
        its own (:meth:`_local_results`), the contributions are summed over
        processes, and the pure functions of
        :mod:`chemtrain.learn.difftre_update` decide and scale the step."""
        params, local = self.params, self._local(batch)
        where = f"update {self.update_count} (epoch {epoch}, state points {batch})"
        try:
            out, new = self._agree(lambda: self._local_results(local, params),
                                   f"computing update {self.update_count}")
        except (NeighborListOverflowError, SimulationError) as e:
            self._fail(f"{type(e).__name__}: {e}", epoch)
        new = self._exchange(new)
        mine = self._contributions(batch, {i: du.host64(o) for i, o in out.items()},
                                   du.host64(params))
        started = time.perf_counter()
        summed = self.strategy.host_sum(mine)
        self._comm_s += time.perf_counter() - started
        loss, grads = du.batch_loss(summed), du.mean_gradient(summed)
        problem = du.failure(summed, batch, where)
        if problem:
            if not np.any(summed["nbr_overflow"]):   # non-finite: say why, where known
                notes = self.strategy.host_allgather_object(
                    [n for i in local if not du.finite(out[i])
                     for n in du.diagnosis(self.statepoints[i], params,
                                           new.get(i, self.trajstates[i]), out[i])])
                notes = list(dict.fromkeys(n for part in notes for n in part))
                problem += "".join(f" Likely cause: {n}" for n in notes)
            self._fail(problem, epoch)
        grads = jax.tree.map(lambda g, p: jnp.asarray(g, jnp.asarray(p).dtype), grads, params)
        updates, opt_state = self._opt_update(grads, self.opt_state, params)
        scale = 1.0
        if self.step_size_search:
            scale, found = du.step_size(
                [self.statepoints[i] for i in local], [new.get(i, self.trajstates[i]) for i in local],
                [float(out[i]["aux"]["n_eff"]) for i in local], params, updates,
                self.step_candidates, self.allowed_reduction, self.strategy.host_sum)
            if not found:
                log.warning("Even a step scaled by %g reduces N_eff below %g of its value; "
                            "taking it.", scale, self.allowed_reduction)
        new_params = self._apply(params, updates, scale)
        if not bool(all_finite((new_params, opt_state))):
            # e.g. a finite gradient of 1e22 overflows Adam's float32 second
            # moment: every later step would be 0 and training silently stop
            norm = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64))))
                                     for g in jax.tree.leaves(grads))))
            self._fail(f"The update gives non-finite parameters or optimizer state in {where}, "
                       f"from a finite loss and a gradient of norm {norm:.3g}: a learning rate "
                       f"or schedule that gives NaN, or a gradient so large that the optimizer's "
                       f"moments overflow, as from a configuration where the potential is "
                       f"enormous (overlapping particles).", epoch)
        self.trajstates.update(new)
        reuses = self._reuses()
        for j, i in enumerate(batch):
            reuses[i] = 0 if summed["recomputed"][j] else reuses[i] + 1
        self.state = self.state.replace(reuses=reuses)
        loss, records = self._records(summed, batch, out, new_params)
        self.state = self.state.replace(params=new_params, opt_state=opt_state,
                                        update_count=self.state.update_count + 1,
                                        update_losses=[*self.state.update_losses, loss])
        if self.consistency_check_every and self.update_count % self.consistency_check_every == 0:
            self.check_consistency()
        if self.on_update is not None:
            self._in_callback = True
            try:
                self.on_update({"update": self.update_count - 1, "epoch": epoch,
                                "batch": list(batch), "params_before": params,
                                "params_after": new_params, "loss": loss, "step_size": scale,
                                "statepoints": records})
            except Exception as e:
                self._stopped = ("callback", self.update_count - 1, type(e).__name__)
                e.add_note(f"(raised by on_update after update {self.update_count - 1}, which "
                           f"was applied)")
                raise
            finally:
                self._in_callback = False
        norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
        return {"loss": loss, "step_size": scale, "statepoints": records, "grad_norm": norm}

    # -- what a trainer on this loop computes per state point -------------------
    def _statepoint_result(self, sp, params, trajs):
        """``(loss, aux), grad`` of state point ``sp`` on ``trajs``: DiffTRe's
        loss (:func:`chemtrain.learn.difftre_update.loss_and_grad`)."""
        return du.loss_and_grad(sp, params, trajs, self._fixed(sp, params, trajs))

    def _contributions(self, batch, out, params):
        """This process's share of the update of ``batch`` (host results
        ``out`` of its state points), for a sum over processes."""
        sps = [self.statepoints[i] for i in batch]
        names = list(sps[0].targets)
        return du.contributions(batch, out, params, names,
                                [{k: np.shape(sp.target_values[k]) for k in names} for sp in sps])

    def _records(self, summed, batch, out, new_params):
        """``(loss, records)`` of the applied update of ``batch``: the batch's
        loss and each state point's record of the history."""
        sps = [self.statepoints[i] for i in batch]
        records = du.records(summed, batch, self.update_count, list(sps[0].targets),
                             [sp.n_snapshots for sp in sps], [sp.target_values for sp in sps])
        self.predictions.update(zip(batch, summed["pred"]))
        return du.batch_loss(summed), records

    def _local_results(self, local, params):
        """Loss, gradient and N_eff of this process's state points ``local``
        (:func:`chemtrain.learn.difftre_update.loss_and_grad`), recomputing
        the trajectory where N_eff is too small; returns (results, new
        trajectories)."""
        out, new = {}, {}
        for i in local:
            sp, trajs = self.statepoints[i], self.trajstates[i]
            self._preflight(sp, trajs)   # trajectories loaded from a file
            (loss, aux), grad = self._statepoint_result(sp, params, trajs)
            n_eff_start = float(aux["n_eff"])
            n_indep = dt.independent_samples([np.asarray(t.U_ref) for t in trajs])
            distance = dt.reuse_distance(n_eff_start, sp.n_snapshots, n_indep)
            recompute = dt.needs_recompute(n_eff_start, sp.n_snapshots, self.reweight_ratio,
                                           n_indep, self.max_reuse_se, self._reuses()[i],
                                           self.max_reuses)
            if recompute:
                keys = [self._train_key(i, c) for c in range(len(trajs))]
                trajs = new[i] = self._run(sp, params, trajs, keys)
                (loss, aux), grad = self._statepoint_result(sp, params, trajs)
            out[i] = {"loss": loss, "aux": aux, "grad": grad, "n_eff_start": n_eff_start,
                      "recomputed": recompute, "n_independent": n_indep, "reuse_se": distance}
        return out, new

    def _fixed(self, sp, params, trajs):
        """:func:`~chemtrain.learn.difftre_update.fixed_quantities` of ``sp``
        on ``trajs``, evaluated once per trajectory."""
        cached = self._fixed_cache.get(sp.index)
        if cached is None or cached[0] is not trajs:
            cached = self._fixed_cache[sp.index] = (trajs, du.fixed_quantities(sp, params, trajs))
        return cached[1]

    def _fail(self, message, epoch):
        self._stopped = ("failed", self.update_count)
        trees, meta = self._capture(with_trajstates=False)
        self.store.fail(message, trees, dict(meta, failed_epoch=epoch),
                        name=f"{self.name}_error_state")

    @collective
    def check_consistency(self) -> None:
        """Raise ``TrainingError`` naming the first leaf of parameters or
        optimizer state whose replicas differ between processes."""
        check_consistency(self.strategy, self.store.host(self.state)[0], self.update_count)

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
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..learn import difftre as dt
from ..parallel import agree, make_strategy, on_root, raised_everywhere
from ..simulate.trajectory import (NeighborListOverflowError, SimulationError, make_trajectory,
                                   run_with_restart)
from . import difftre_io
from .services import (CheckpointStore, Reporter, check_consistency, checked_params, close_epoch,
                       collective, init_state)
from .state import DifftreState

log = logging.getLogger("chemtrain")


class _Functions:
    """The compiled functions of state points that share a potential,
    simulator, quantities and targets (DifftreParallel: all of them)."""

    def __init__(self, energy_fn_template, simulator_template, neighbor_fn, timings, quantities,
                 targets, observables, loss_fn, vmap_batch):
        self.init_fn, self.run_fn = make_trajectory(simulator_template, energy_fn_template,
                                                    neighbor_fn, timings)
        self.neighbor_fn = neighbor_fn
        self._loss_args = (energy_fn_template, dict(quantities), targets, observables, loss_fn,
                           vmap_batch)
        dt.resolve_observables(targets, quantities, observables, require_values=False)
        self.fixed = None  # quantities that ignore the potential, known after the first trajectory
        n_eff = dt.make_neff_fn(energy_fn_template, vmap_batch)

        def candidates(params, updates, scales, chains, U_ref, state_kwargs):
            return jax.lax.map(lambda a: n_eff(dt.scaled_params(params, updates, a), chains, U_ref,
                                               state_kwargs), scales)
        self.n_eff_candidates = jax.jit(candidates)

    def prepare(self, trajs, state_kwargs):
        """Sort the quantities into potential-dependent ones (evaluated in the
        loss) and the others (evaluated once per trajectory), then build the
        loss."""
        if self.fixed is not None:
            return
        template, quantities, targets, observables, loss_fn, vmap_batch = self._loss_args
        snapshot = jax.tree.map(lambda x: x[0], trajs[0].snapshots)
        dependent = dt.potential_dependent(quantities, snapshot, trajs[0].nbrs, state_kwargs)
        self.fixed = tuple(k for k in quantities if k not in dependent)
        loss = dt.make_statepoint_loss(template, quantities, targets, observables, loss_fn,
                                       vmap_batch, fixed=self.fixed)
        self.loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
        self.fixed_values = jax.jit(dt.make_snapshot_evaluator(
            None, {k: quantities[k] for k in self.fixed}, vmap_batch))


class _StatePoint:
    """Everything fixed about one state point: its functions and data."""

    def __init__(self, index, name, fns, state_kwargs, reference, targets, target_values,
                 n_snapshots):
        self.index, self.name, self.fns = index, name, fns
        self.init_fn, self.run_fn, self.neighbor_fn = fns.init_fn, fns.run_fn, fns.neighbor_fn
        self.state_kwargs = state_kwargs  # this state point's values, as jnp arrays
        self.reference = reference        # (chains, N, dim) initial positions
        self.targets = targets            # {name: {'gamma', 'loss_fn'?, 'target'}}
        self.target_values = target_values
        self.n_snapshots = n_snapshots * reference.shape[0]


def _chains(trajs):
    return [(t.snapshots, t.nbrs) for t in trajs]


def _U_ref(trajs):
    return jnp.concatenate([jnp.ravel(t.U_ref) for t in trajs])


def _host(x):
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), x)


class _DifftreCore:
    """The training loop shared by :class:`DifftreParallel` and :class:`Difftre`."""

    trainer_name = "Difftre"

    def _setup(self, key, init_params, optimizer, *, sim_batch_size, parallelism, reweight_ratio,
               step_size_search, allowed_reduction, n_step_candidates,
               overflow_capacity_multiplier, max_neighbor_retries, checkpoint_path, log_file,
               plot_file, plot_x, progress, consistency_check_every, name, on_update=None):
        if not (isinstance(reweight_ratio, (int, float)) and 0.0 <= reweight_ratio <= 1.0):
            raise ValueError(f"reweight_ratio must be a number in [0, 1] (recompute when "
                             f"N_eff < reweight_ratio * N), got {reweight_ratio!r}.")
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
        key = jax.random.PRNGKey(0) if key is None else key
        if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)  # raw key data: plain numbers in saved states
        self.key = jnp.asarray(key)
        self.optimizer = optimizer
        self.sim_batch_size = sim_batch_size
        self.reweight_ratio = float(reweight_ratio)
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
        self.state = DifftreState(params, jax.tree.map(jnp.asarray, self.strategy.broadcast_from_root(
            jax.tree.map(np.asarray, optimizer.init(params)))))
        self.statepoints: list[_StatePoint] = []
        self.trajstates: dict[int, list] = {}
        self.predictions: dict[int, dict] = {}
        self._fixed_cache: dict[int, tuple] = {}  # state point -> (trajs, values, overflows)
        self._templates: dict = {}  # trajectory-state structures (see difftre_io.unpack)
        self._comm_s = self._wait_s = 0.0  # this epoch: exchanges, waiting for others
        self._mid_epoch = False  # an update of an epoch failed: no resumable checkpoint
        self._apply = jax.jit(lambda p, u, a: dt.scaled_params(p, u, a))
        self._opt_update = jax.jit(optimizer.update)

    @property
    def n_statepoints(self) -> int:
        return len(self.statepoints)

    # -- state ------------------------------------------------------------------
    @property
    def params(self):
        return self.state.params

    @params.setter
    def params(self, params) -> None:
        host = checked_params(self.strategy, jax.tree.map(np.asarray, self.state.params), params)
        self.state = self.state.replace(params=jax.tree.map(jnp.asarray, host))

    opt_state = property(lambda self: self.state.opt_state)
    epoch = property(lambda self: self.state.epoch)
    update_count = property(lambda self: self.state.update_count)
    init_runs = property(lambda self: self.state.init_runs)
    history = property(lambda self: self.state.history)
    epoch_losses = property(lambda self: self.state.epoch_losses)
    update_losses = property(lambda self: self.state.update_losses)

    # -- building state points ----------------------------------------------
    def _add(self, fns, state_kwargs, reference, targets, target_values, n_snapshots, name=None):
        index = len(self.statepoints)
        if "kT" not in state_kwargs:
            raise ValueError(f"State point {index}: state_kwargs must contain 'kT' (thermal energy "
                             f"in kJ/mol, e.g. chemtrain.units.kT(300.0)); got keys "
                             f"{sorted(state_kwargs)}.")
        reference = jnp.asarray(reference)
        if reference.ndim == 2:
            reference = reference[None]
        if reference.ndim != 3:
            raise ValueError(f"State point {index}: the reference state must be positions of shape "
                             f"(N, dim) or (chains, N, dim), got shape {reference.shape}.")
        sp = _StatePoint(index, name if name is not None else f"{index}", fns,
                         {k: jnp.asarray(v) for k, v in state_kwargs.items()}, reference,
                         targets, {k: jnp.asarray(v) for k, v in target_values.items()},
                         n_snapshots)
        self.statepoints.append(sp)
        return sp

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
        crc, shapes = 0, []
        for sp in self.statepoints:
            arrays = [*(sp.state_kwargs[k] for k in sorted(sp.state_kwargs)), sp.reference,
                      *(sp.target_values[k] for k in sorted(sp.target_values))]
            shapes.append([list(np.shape(a)) for a in arrays])
            for a in arrays:
                crc = zlib.crc32(np.ascontiguousarray(np.asarray(a)).tobytes(), crc)
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
        out = difftre_io.unpack(self, theirs, self._templates)
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

    # -- trajectories -----------------------------------------------------------
    def _run(self, sp, params, trajs, keys):
        out = []
        for c, (t, k) in enumerate(zip(trajs, keys)):
            out.append(run_with_restart(
                sp.run_fn, sp.neighbor_fn, params, t, k,
                overflow_capacity_multiplier=self.overflow_capacity_multiplier,
                max_neighbor_retries=self.max_neighbor_retries,
                statepoint=sp.name if sp.reference.shape[0] == 1 else f"{sp.name}, chain {c}",
                **sp.state_kwargs))
        return out

    @collective
    def initialize_trajstates(self, num_runs: int = 1, statepoints=None) -> None:
        """Sample the first trajectory of every state point (or of the given
        ``statepoints``) from its reference state: ``num_runs`` trajectories
        in a row, of which all but the last serve as equilibration."""
        if not self.statepoints:
            raise ValueError("There are no state points; add them first.")
        if not (isinstance(num_runs, int) and num_runs >= 1):
            raise ValueError(f"num_runs must be a positive integer, got {num_runs!r}.")
        self._check_statepoints("initialize_trajstates")
        base = jax.random.fold_in(self.key, 1)
        mine = self._local([i for i in range(self.n_statepoints)
                            if statepoints is None or i in statepoints])

        def compute():
            new = {}
            bar = self.reporter.bar(len(mine) * num_runs, "initial trajectories")
            for i in mine:
                sp = self.statepoints[i]
                trajs = [sp.init_fn(self.params, dt.statepoint_key(base, i, 0, c), R0,
                                    **sp.state_kwargs) for c, R0 in enumerate(sp.reference)]
                for r in range(num_runs):
                    keys = [dt.statepoint_key(base, i, r + 1, c) for c in range(len(trajs))]
                    trajs = self._run(sp, self.params, trajs, keys)
                    bar.update()
                new[i] = trajs
            bar.close()
            return new

        self.trajstates.update(self._exchange(
            self._agree(compute, "sampling initial trajectories")))
        self.state = self.state.replace(init_runs=num_runs)

    # -- training ---------------------------------------------------------------
    @collective
    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more epochs; every state point is used once per
        epoch. Checkpoint every ``checkpoint_freq`` epochs; write the plot of
        predictions against targets at the end if ``plot_file`` was given."""
        self._check_statepoints("train")
        missing = [i for i in range(self.n_statepoints) if i not in self.trajstates]
        if missing:
            raise RuntimeError(f"State point(s) {missing} have no trajectory yet: call "
                               f"trainer.initialize_trajstates() (or load_trajstates(path)) "
                               f"before train().")
        if checkpoint_freq:
            self.store.check_folder()
        batches = self.batches()
        epochs = self.reporter.epochs(self.epoch, max_epochs)
        for epoch in epochs:
            started, self._comm_s, self._wait_s = time.perf_counter(), 0.0, 0.0
            self._mid_epoch = True
            bar = self.reporter.bar(len(batches), f"epoch {epoch}")
            per_sp, step_sizes = {}, []
            for batch in batches:
                result = self._update(batch, epoch)
                per_sp.update(result["statepoints"])
                step_sizes.append(result["step_size"])
                bar.set_postfix(loss=f"{result['loss']:.4g}")
                bar.update()
            bar.close()
            self._mid_epoch = False
            loss = float(np.mean([per_sp[i]["loss"] for i in sorted(per_sp)]))
            record = {"epoch": epoch, "update": self.update_count, "loss": loss,
                      "step_sizes": step_sizes,
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
        params, local = self.params, self._local(batch)
        names = list(self.statepoints[batch[0]].targets)

        def compute():
            out, new = {}, {}
            for i in local:
                sp, trajs = self.statepoints[i], self.trajstates[i]
                (loss, aux), grad = self._loss_and_grad(sp, params, trajs)
                n_eff_start = float(aux["n_eff"])
                recompute = dt.needs_recompute(n_eff_start, sp.n_snapshots, self.reweight_ratio)
                if recompute:
                    keys = [self._train_key(i, c) for c in range(len(trajs))]
                    trajs = new[i] = self._run(sp, params, trajs, keys)
                    (loss, aux), grad = self._loss_and_grad(sp, params, trajs)
                out[i] = {"loss": loss, "aux": aux, "grad": grad, "n_eff_start": n_eff_start,
                          "recomputed": recompute}
            return out, new

        try:
            out, new = self._agree(compute, f"computing update {self.update_count}")
        except (NeighborListOverflowError, SimulationError) as e:
            self._fail(f"{type(e).__name__}: {e}", epoch)
        new = self._exchange(new)

        # every state point of the batch in one summed buffer (zeros where not computed here)
        n = len(batch)
        buf = {"grad": jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), _host(params)),
               "loss": np.zeros(n), "n_eff": np.zeros(n), "n_eff_start": np.zeros(n),
               "recomputed": np.zeros(n), "nbr_overflow": np.zeros(n),
               "parts": {k: np.zeros(n) for k in names},
               "pred": [{k: np.zeros(np.shape(self.statepoints[i].target_values[k]))
                         for k in names} for i in batch]}
        for j, i in enumerate(batch):
            if i not in out:
                continue
            o = _host(out[i])
            buf["grad"] = jax.tree.map(np.add, buf["grad"], o["grad"])
            buf["loss"][j], buf["n_eff"][j] = o["loss"], o["aux"]["n_eff"]
            buf["n_eff_start"][j], buf["recomputed"][j] = o["n_eff_start"], o["recomputed"]
            buf["nbr_overflow"][j] = o["aux"]["nbr_overflow"]
            for k in names:
                buf["parts"][k][j] = o["aux"]["parts"].get(k, np.nan)
                buf["pred"][j][k] = np.asarray(o["aux"]["predictions"][k]).reshape(
                    buf["pred"][j][k].shape)
        started = time.perf_counter()
        buf = self.strategy.host_sum(buf)
        self._comm_s += time.perf_counter() - started
        loss = float(np.sum(buf["loss"]) / n)
        where = f"update {self.update_count} (epoch {epoch}, state points {batch})"
        if np.any(buf["nbr_overflow"]):
            bad = [batch[j] for j in np.nonzero(buf["nbr_overflow"])[0]]
            self._fail(f"The neighbor list overflowed on stored snapshots of state point(s) {bad} "
                       f"in {where}.", epoch)
        grads = jax.tree.map(lambda g: g / n, buf["grad"])
        finite_grad = all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
        if not (math.isfinite(loss) and finite_grad):
            bad = [batch[j] for j in range(n) if not np.isfinite(buf["loss"][j])]
            self._fail(f"The loss is {loss} (gradient finite: {finite_grad}) in {where}"
                       + (f"; non-finite at state point(s) {bad}" if bad else "")
                       + ". Lower the learning rate or check the targets and the potential.", epoch)
        grads = jax.tree.map(lambda g, p: jnp.asarray(g, jnp.asarray(p).dtype), grads, params)
        updates, opt_state = self._opt_update(grads, self.opt_state, params)
        scale = self._step_size(local, out, new, params, updates) if self.step_size_search else 1.0
        new_params = self._apply(params, updates, scale)
        if not all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(new_params)):
            self._fail(f"The update gives non-finite parameters in {where}.", epoch)
        self.state = self.state.replace(params=new_params, opt_state=opt_state,
                                        update_count=self.state.update_count + 1,
                                        update_losses=[*self.state.update_losses, loss])
        self.trajstates.update(new)
        if self.consistency_check_every and self.update_count % self.consistency_check_every == 0:
            self.check_consistency()
        records = {}
        for j, i in enumerate(batch):
            pred = buf["pred"][j]
            self.predictions[i] = pred
            sp = self.statepoints[i]
            records[i] = {"statepoint": i, "update": self.update_count - 1,
                          "loss": float(buf["loss"][j]),
                          "parts": {k: float(buf["parts"][k][j]) for k in names
                                    if not np.isnan(buf["parts"][k][j])},  # none with loss_fn
                          "n_eff": float(buf["n_eff_start"][j]), "n_snapshots": sp.n_snapshots,
                          "recomputed": bool(buf["recomputed"][j]),
                          "predictions": {k: pred[k].tolist() for k in names},
                          "targets": {k: np.asarray(sp.target_values[k]).tolist() for k in names}}
        if self.on_update is not None:
            self.on_update({"update": self.update_count - 1, "epoch": epoch, "batch": list(batch),
                            "params_before": params, "params_after": new_params, "loss": loss,
                            "step_size": scale, "statepoints": records})
        return {"loss": loss, "step_size": scale, "statepoints": records}

    def _loss_and_grad(self, sp, params, trajs):
        """(loss, aux), grad of one state point on ``trajs``; the quantities
        that ignore the potential are evaluated once per trajectory."""
        sp.fns.prepare(trajs, sp.state_kwargs)
        cached = self._fixed_cache.get(sp.index)
        if cached is None or cached[0] is not trajs:
            _, values, n_overflow = sp.fns.fixed_values(params, _chains(trajs), sp.state_kwargs)
            cached = self._fixed_cache[sp.index] = (trajs, values, n_overflow)
        (loss, aux), grad = sp.fns.loss_and_grad(params, _chains(trajs), _U_ref(trajs),
                                                 sp.target_values, sp.state_kwargs, cached[1])
        return (loss, dict(aux, nbr_overflow=aux["nbr_overflow"] + cached[2])), grad

    def _step_size(self, local, out, new, params, updates) -> float:
        """Largest candidate scale of ``updates`` that keeps N_eff >=
        allowed_reduction x its value at every state point of the batch."""
        scales = jnp.asarray(self.step_candidates)
        table, now = [], []
        for i in local:
            sp = self.statepoints[i]
            trajs = new.get(i, self.trajstates[i])
            table.append(np.asarray(sp.fns.n_eff_candidates(params, updates, scales, _chains(trajs),
                                                        _U_ref(trajs), sp.state_kwargs)))
            now.append(float(out[i]["aux"]["n_eff"]))
        violations = (dt.step_size_violations(np.array(table), np.array(now),
                                              self.allowed_reduction)
                      if local else np.zeros(len(self.step_candidates), np.int64))
        scale, found = dt.choose_step_size(self.step_candidates, self.strategy.host_sum(violations))
        if not found:
            log.warning("Even a step scaled by %g reduces N_eff below %g of its value; taking it.",
                        scale, self.allowed_reduction)
        return scale

    def _fail(self, message, epoch):
        trees, meta = self._capture(with_trajstates=False)
        self.store.fail(message, trees, dict(meta, failed_epoch=epoch),
                        name=f"{self.name}_error_state")

    @collective
    def check_consistency(self) -> None:
        """Raise ``TrainingError`` naming the first leaf of parameters or
        optimizer state whose replicas differ between processes."""
        check_consistency(self.strategy, self.store.host(self.state)[0], self.update_count)

    # -- files ------------------------------------------------------------------
    def _capture(self, with_trajstates=True):
        trees, meta = self.store.host(self.state)
        meta = dict(meta, reweight_ratio=self.reweight_ratio, n_statepoints=self.n_statepoints,
                    sim_batch_size=self.sim_batch_size)
        if with_trajstates and self.trajstates:
            data, info = difftre_io.trajstates_to_host(self.trajstates)
            trees["trajstates"], meta["trajstates"] = data, info
        return trees, meta

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write parameters, optimizer state, histories and the trajectory
        states to ``path`` (plain data, atomic, root process). Call it on
        every process, after a completed epoch."""
        if self._mid_epoch:
            raise RuntimeError(
                f"Epoch {self.epoch} did not complete (update {self.update_count} failed), so a "
                f"checkpoint now could not be resumed; restore the last epoch checkpoint instead "
                f"(the error state in {self.store.folder!r} holds the failed state for diagnosis).")
        self.store.save(path, *self._capture())

    @collective
    def restore(self, path: str, trajstates: bool = True) -> None:
        """Continue from a checkpoint of this trainer (same state points and
        sim_batch_size); also load its trajectory states unless
        ``trajstates=False``."""
        state, meta, _ = self.store.restore(
            path, self.state, {"n_shards": self.strategy.n_shards,
                               "n_statepoints": self.n_statepoints,
                               "sim_batch_size": self.sim_batch_size})
        self.state = jax.tree.map(jnp.asarray, state)  # uncommitted, as trained ones
        self._mid_epoch = False
        if trajstates and meta.get("trajstates"):
            self.load_trajstates(path)

    @collective
    def save_trajstates(self, path: str) -> None:
        """Write the trajectory states (plain-data npz, root process)."""
        if not self.trajstates:
            raise RuntimeError("There are no trajectory states to save; call "
                               "initialize_trajstates() first.")
        data, info = difftre_io.trajstates_to_host(self.trajstates)
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
            self, meta, leaves, range(self.n_statepoints), path))

    @collective
    def plot(self, path: str) -> None:
        """Plot the latest predictions against the targets of every state
        point (curves for arrays, bars for scalars) into ``path``."""
        on_root(self.strategy, lambda: difftre_io.plot(self, path), only_root=True)

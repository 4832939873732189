"""``RelativeEntropy`` (upstream chemtrain's name): relative-entropy
minimisation of a (coarse-grained) potential against mapped reference
configurations, on the DiffTRe loop of :mod:`.difftre_core`.

It shares everything with DiffTRe but the per-state-point numbers: the
trajectories (reused while N_eff >= reweight_ratio x N, the parameters stay
within max_reuse_se standard errors of the trajectory's own estimate and it
has served fewer than max_reuses updates; recomputed otherwise;
neighbor-list restarts), the step-size search, state points spread over
MPI ranks, checkpoints, error states and trajectory files. Per state point
and update it computes the relative-entropy gradient from its
stored snapshots and a random batch of its reference configurations
(:mod:`chemtrain.learn.relative_entropy`), and after the update the
estimated change of the relative entropy, whose running sum per state point
is the loss the trainer reports.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable

import jax
import numpy as np

from ..ensemble import is_npt
from ..learn import difftre as dt
from ..learn import difftre_update as du
from ..learn import relative_entropy as re_fns
from ..parallel import on_root
from .difftre import statepoint_inputs
from .difftre_core import _DifftreCore
from .services import collective
from .state import RelEntropyState
from .statepoint import SimulationFunctions


class RelativeEntropyFunctions(SimulationFunctions):
    """The compiled functions of relative-entropy state points sharing a
    potential, simulator and neighbor list."""

    def __init__(self, energy_fn_template, simulator_template, neighbor_fn, timings, vmap_batch):
        super().__init__(energy_fn_template, simulator_template, neighbor_fn, timings, vmap_batch)
        self.loss_and_grad = jax.jit(jax.value_and_grad(
            re_fns.make_loss(energy_fn_template, vmap_batch), has_aux=True))
        self.change = jax.jit(re_fns.make_change(energy_fn_template, vmap_batch))
        self.reference_energies = jax.jit(re_fns.reference_energies_fn(energy_fn_template, None))


class ReferenceFrames:
    """The reference configurations of one state point: an array (frames, N,
    dim), or a loader with ``read_indices(rows)`` and a ``schema`` holding ``'R'``
    (:class:`chemtrain.data.HDF5ParallelDataLoader`), read batch by batch.
    Checked against the simulation's (N, dim); cast to its dtype."""

    def __init__(self, data, frame_shape, dtype, batch_size, where: str):
        self.where, self.dtype, self._checksum = where, np.dtype(dtype), None
        self.loader = data if hasattr(data, "read_indices") and hasattr(data, "schema") else None
        if self.loader is not None:
            if "R" not in self.loader.schema:
                raise ValueError(f"{where}: the reference loader has no dataset 'R' (positions); "
                                 f"it has {sorted(self.loader.schema)}.")
            shape, self.n = (int(self.loader.n), *self.loader.schema["R"][0]), int(self.loader.n)
            self.array = None
        else:
            try:
                self.array = np.asarray(data)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{where}: reference_data must be an array of positions (frames, "
                                f"N, dim) or a chemtrain loader, got {type(data).__name__}.") from e
            shape, self.n = self.array.shape, (len(self.array) if self.array.ndim else 0)
            if self.array.dtype.kind not in "fiu":
                raise TypeError(f"{where}: reference_data must hold numbers, got dtype "
                                f"{self.array.dtype}.")
        if len(shape) != 3:
            raise ValueError(f"{where}: reference_data must have shape (frames, N, dim), got "
                             f"{tuple(shape)}.")
        if self.n == 0:
            raise ValueError(f"{where}: reference_data is empty (0 frames); relative entropy "
                             f"needs reference configurations.")
        if tuple(shape[1:]) != tuple(frame_shape):
            raise ValueError(f"{where}: the reference configurations have {shape[1]} particles "
                             f"in {shape[2]} dimensions, but the simulation has "
                             f"{frame_shape[0]} in {frame_shape[1]} (reference_state); map them "
                             f"to the coarse-grained sites of the model first.")
        if self.array is not None:
            self.array = self.array.astype(self.dtype, copy=False)
            self.check_finite(self.array, np.arange(self.n))
        if batch_size is None:
            batch_size = self.n
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"{where}: reference_batch_size must be a positive whole number or "
                             f"None, got {batch_size!r}.")
        if batch_size > self.n:
            raise ValueError(f"{where}: reference_batch_size={batch_size} is larger than the "
                             f"reference data ({self.n} frames); use at most {self.n}.")
        self.batch_size = int(batch_size)

    def check_finite(self, R, rows) -> None:
        bad = ~np.isfinite(R).reshape(len(R), -1).all(axis=1)
        if bad.any():
            frames = np.asarray(rows)[bad][:5].tolist()
            raise ValueError(f"{self.where}: reference frame(s) {frames} hold NaN or infinite "
                             f"positions; remove them from reference_data.")

    def take(self, rows):
        """The frames ``rows``, checked finite, in the simulation's dtype."""
        if self.array is not None:
            return self.array[rows]
        R = np.asarray(self.loader.read_indices(rows)["R"]).astype(self.dtype, copy=False)
        self.check_finite(R, rows)
        return R

    def fingerprint(self):
        """What must be equal on every process: the array, or the loader's
        file and size, with the batch size."""
        if self.array is not None:
            return np.append(np.ravel(self.array).astype(np.float64), self.batch_size)
        if self._checksum is None:   # the content: node-local copies may differ
            crc = 0
            for start in range(0, self.n, 1024):
                R = self.loader.read_indices(np.arange(start, min(start + 1024, self.n)))["R"]
                crc = zlib.crc32(np.ascontiguousarray(R).tobytes(), crc)
            self._checksum = crc
        name = str(getattr(self.loader, "path", type(self.loader).__name__))
        return np.array([zlib.crc32(name.encode()), self.n, self.batch_size, self._checksum])


class RelativeEntropy(_DifftreCore):
    """Relative-entropy minimisation of a potential (upstream chemtrain's trainer).

    Build the trainer with ``RelativeEntropy(init_params, optimizer,
    reweight_ratio=0.9, sim_batch_size=1)``, then call :meth:`add_statepoint`
    once per state point and :meth:`train`. Each update draws a batch of
    reference configurations per state point and takes the gradient
    ``beta (<dU/dtheta>_ref - <dU/dtheta>_theta)``, with the model average
    reweighted from the stored trajectory, and averages it over the batch's
    state points. A trajectory is recomputed when N_eff < reweight_ratio x N,
    when the parameters have moved more than ``max_reuse_se`` standard errors
    of that trajectory's own estimate since it was sampled, or after
    ``max_reuses`` reuses (see :mod:`chemtrain.learn.reuse`). NVT state points
    only. The options shared with DiffTRe mean what they mean in
    :class:`DifftreParallel`; the entries below say so briefly. Units are
    chemtrain's: nm, kJ/mol, ps, amu.

    The ``history`` records per state point and update: ``loss`` (the
    estimated change of the relative entropy since the initial parameters,
    the running sum of ``delta_s_rel``), ``delta_s_rel`` (this update's
    change, by free-energy perturbation), ``grad_norm`` (of its gradient),
    ``n_eff`` (before any recompute), ``recomputed``, ``n_independent``
    (decorrelated samples of the trajectory it started from) and
    ``reuse_se`` (how far the parameters had moved from it, in its standard
    errors); per epoch the norm of every update's mean gradient
    (``grad_norms``) and its step sizes.

    Args:
      init_params: initial parameter pytree (floating-point arrays).
      optimizer: an ``optax.GradientTransformation``.
      reweight_ratio: recompute a trajectory when N_eff < ratio x N, a number
        in [0, 1].
      sim_batch_size: state points per update (-1: all); a remainder joins
        the last batch. It must not exceed the number of state points once
        training starts, and under MPI it must be at least the number of
        ranks; as in :class:`DifftreParallel`.
      energy_fn_template: default ``params -> energy_fn(R, neighbor,
        **kwargs)`` for state points added without a template of their own
        (None: every :meth:`add_statepoint` must give one).
      key: JAX random key, or an integer seed, from which the trajectory and
        reference-batch keys derive; None means ``PRNGKey(0)``.
      parallelism: 'auto', 'single' or 'mpi'; as in :class:`DifftreParallel`.
      max_reuse_se: recompute once the parameters have moved more than this
        many standard errors of the trajectory's own estimate (a positive
        number, or None for no such limit).
      max_reuses: recompute a trajectory that has served this many updates
        after the one it was sampled for (a whole number >= 0, or None for no
        limit).
      step_size_search: scale each update down (1, 1/2, 1/4, ...) until N_eff
        keeps ``allowed_reduction`` of its value at every state point.
      allowed_reduction: fraction of N_eff, in (0, 1], that a step found by
        the step-size search must keep; if even the smallest candidate does
        not keep it, that smallest step is taken with a warning.
      n_step_candidates: number of scales the step-size search tries, 1, 1/2,
        ..., 2**-(n_step_candidates - 1); at least 1.
      overflow_capacity_multiplier: growth factor of the neighbor-list
        capacity on an overflow (:func:`chemtrain.simulate.run_with_restart`).
      max_neighbor_retries: restarts of a trajectory after neighbor-list
        overflows before giving up (:func:`chemtrain.simulate.run_with_restart`).
      checkpoint_path: folder of the epoch checkpoints and of
        ``<name>_error_state.npz``.
      log_file: JSON-lines metrics file, one line per epoch (None: none).
      plot_file: where :meth:`train` writes, at its end, the plot of
        :meth:`plot` (relative-entropy change, gradient norm and N_eff / N
        per update); None: no plot.
      plot_x: accepted for symmetry with DiffTRe; relative-entropy state
        points have no targets, so a non-empty ``plot_x`` is refused when a
        state point is added. Leave it None.
      progress: show progress bars (on the root process only).
      consistency_check_every: every this many updates, check that the
        parameters and optimizer state agree on all processes; None: never.
      name: the run's name, used in the file name ``<name>_error_state.npz``.
      on_update: optional ``fn(record)`` called on every process after each
        applied update; the record is as in :class:`DifftreParallel`, with
        the per-state-point records of the history above.

    Attributes:
      params: the current parameters.
      opt_state: the optimizer state.
      trajstates: state point -> list of :class:`chemtrain.simulate.TrajState`,
        one per chain.
      history: one record per epoch, as written to ``log_file``.
      epoch_losses: the loss of every epoch (the mean over state points of
        the running relative-entropy change).
      update_losses: the loss of every update.
      epoch: epochs trained so far.
      update_count: updates applied so far.
      statepoints: the :class:`~chemtrain.trainers.StatePoint` objects, in the
        order they were added; each one's ``data`` holds its reference
        configurations.

    Raises:
      ValueError: if ``reweight_ratio``, ``max_reuse_se``, ``max_reuses``,
        ``allowed_reduction``, ``n_step_candidates`` or ``sim_batch_size`` is
        out of range, if ``sim_batch_size`` is smaller than the number of MPI
        ranks, if ``parallelism`` is unknown or asks for JAX sharding (also
        when ``jax.distributed`` runs several processes), if ``init_params``
        holds no arrays, or if ``log_file`` is a folder.
      TypeError: if ``optimizer`` is not an ``optax.GradientTransformation``,
        ``on_update`` is not callable, ``key`` is neither a seed nor a JAX
        key, a leaf of ``init_params`` is not floating point, or ``log_file``
        is not a path.
    """

    trainer_name = "RelativeEntropy"
    state_class = RelEntropyState

    def __init__(self, init_params, optimizer, reweight_ratio: float = 0.9,
                 sim_batch_size: int = 1, energy_fn_template: Callable | None = None, *,
                 key=None, parallelism: str = "auto",
                 max_reuse_se: float | None = 0.2, max_reuses: int | None = 4,
                 step_size_search: bool = False, allowed_reduction: float = 0.5,
                 n_step_candidates: int = 10, overflow_capacity_multiplier: float = 1.5,
                 max_neighbor_retries: int = 3, checkpoint_path: str = "checkpoints",
                 log_file: str | None = None, plot_file: str | None = None, plot_x=None,
                 progress: bool = True, consistency_check_every: int | None = None,
                 name: str = "relentropy", on_update: Callable | None = None):
        self.energy_fn_template = energy_fn_template
        self._functions: list = []   # (inputs, RelativeEntropyFunctions) shared by state points
        self._reference_batch: dict = {}   # (state point, stream) -> (update, reference batch)
        self._data_nbrs: dict = {}   # state point -> neighbor list of its reference frames
        super().__init__(
            key, init_params, optimizer, sim_batch_size=sim_batch_size,
            reweight_ratio=reweight_ratio, parallelism=parallelism, max_reuse_se=max_reuse_se, max_reuses=max_reuses,
            step_size_search=step_size_search, allowed_reduction=allowed_reduction,
            n_step_candidates=n_step_candidates,
            overflow_capacity_multiplier=overflow_capacity_multiplier,
            max_neighbor_retries=max_neighbor_retries, checkpoint_path=checkpoint_path,
            log_file=log_file, plot_file=plot_file, plot_x=plot_x, progress=progress,
            consistency_check_every=consistency_check_every, name=name, on_update=on_update)

    @collective
    def add_statepoint(self, reference_data, energy_fn_template, simulator_template, neighbor_fn,
                       timings, state_kwargs, reference_state, reference_batch_size=None,
                       vmap_batch: int | None = 10, initialize_traj: bool = True) -> int:
        """Add one state point (upstream's argument order).

        ``reference_data``: mapped reference configurations (frames, N, dim)
        or a loader of them (e.g. ``HDF5ParallelDataLoader(path, keys=['R'])``).
        ``reference_batch_size``: frames per update (None: all). Other
        arguments as in :meth:`Difftre.add_statepoint`. Returns the state
        point's index."""
        state_kwargs, reference_state = statepoint_inputs(state_kwargs, reference_state)
        template = energy_fn_template or self.energy_fn_template
        if template is None:
            raise ValueError("add_statepoint needs an energy_fn_template (or give one to "
                             "RelativeEntropy).")
        index = len(self.statepoints)
        R0 = np.asarray(reference_state)
        data = ReferenceFrames(reference_data, R0.shape[-2:], R0.dtype, reference_batch_size,
                               f"State point {index}")
        fns = self._shared_functions(template, simulator_template, neighbor_fn, timings,
                                     vmap_batch)
        sp = self._add(fns, state_kwargs, reference_state, {}, {}, timings.n_snapshots, data=data)
        self.state = self.state.replace(s_rel=[*self.state.s_rel, 0.0])
        self._check_statepoints(f"add_statepoint of state point {sp.index}")
        if initialize_traj:
            self.initialize_trajstates(1, statepoints=[sp.index])
        return sp.index

    def _shared_functions(self, *inputs):
        """One compiled set per distinct (potential, simulator, neighbor list,
        timings, vmap_batch): state points that share them compile once."""
        for known, fns in self._functions:
            if all(a is b for a, b in zip(known, inputs)):
                return fns
        fns = RelativeEntropyFunctions(*inputs)
        self._functions.append((inputs, fns))
        return fns

    # -- the per-state-point numbers of the shared loop --------------------------
    def _reference(self, sp, stream: int = 2):
        """This update's reference batch of ``sp`` for the gradient (stream 2)
        or the change estimate (stream 3), drawn from a key of the state
        point and the update count only."""
        cached = self._reference_batch.get((sp.index, stream))
        if cached is None or cached[0] != self.update_count:
            key = dt.statepoint_key(jax.random.fold_in(self.key, stream), sp.index,
                                    self.update_count)
            rows = re_fns.reference_batch_indices(key, sp.data.n, sp.data.batch_size)
            cached = (self.update_count, sp.data.take(rows))
            self._reference_batch[(sp.index, stream)] = cached
        return cached[1]

    def _on_reference_frames(self, sp, R, fn):
        """``fn(nbrs)`` (returning ``(result, per-frame overflow)``) with the
        state point's reference neighbor list, allocated on the first
        overflowing frame and evaluated again until every frame fits."""
        for _ in range(len(R) + 1):
            nbrs = self._data_nbrs.get(sp.index)
            if nbrs is None:
                nbrs = self._data_nbrs[sp.index] = sp.neighbor_fn.allocate(R[0])
            result, overflow = fn(nbrs)
            bad = np.flatnonzero(np.asarray(overflow))
            if not len(bad):
                return result
            self._data_nbrs[sp.index] = sp.neighbor_fn.allocate(R[int(bad[0])])
        raise RuntimeError(f"State point {sp.name}: the neighbor list of the reference frames "
                           f"still overflows after growing it for every frame.")

    def _statepoint_result(self, sp, params, trajs):
        R = self._reference(sp)

        def evaluate(nbrs):
            (value, aux), grad = sp.fns.loss_and_grad(params, du.chains_of(trajs),
                                                      du.energies_of(trajs), R, nbrs,
                                                      sp.state_kwargs)
            return ((value, dict(aux, predictions={}, parts={})), grad), aux["data_overflow"]
        return self._on_reference_frames(sp, R, evaluate)

    def _contributions(self, batch, out, params):
        mine = du.contributions(batch, out, params, [], [{} for _ in batch])
        mine["grad_norm"] = np.array([_norm(out[i]["grad"]) if i in out else 0.0 for i in batch])
        return mine

    def _records(self, summed, batch, out, new_params):
        params = self.params
        def changes():
            delta = np.zeros(len(batch))
            for j, i in enumerate(batch):
                if i in out:
                    sp, aux = self.statepoints[i], out[i]["aux"]
                    R = self._reference(sp, 3)
                    delta[j] = float(self._on_reference_frames(sp, R, lambda nbrs: sp.fns.change(
                        params, new_params, du.chains_of(self.trajstates[i]), aux["U"],
                        aux["weights"], R, nbrs, sp.state_kwargs)))
            return delta
        delta = self.strategy.host_sum(self._agree(changes, "estimating the relative-entropy "
                                                            "change"))
        s_rel, records = list(self.state.s_rel), {}
        for j, i in enumerate(batch):
            s_rel[i] += float(delta[j])
            records[i] = {"statepoint": i, "update": self.update_count, "loss": s_rel[i],
                          "delta_s_rel": float(delta[j]),
                          "grad_norm": float(summed["grad_norm"][j]),
                          "n_eff": float(summed["n_eff_start"][j]),
                          "n_snapshots": self.statepoints[i].n_snapshots,
                          "recomputed": bool(summed["recomputed"][j]),
                          "n_independent": float(summed["n_independent"][j]),
                          "reuse_se": float(summed["reuse_se"][j])}
        self.state = self.state.replace(s_rel=s_rel)
        return float(np.mean([s_rel[i] for i in batch])), records

    def _preflight(self, sp, trajs):
        """DiffTRe's first-configuration check, then: NVT only, and the first
        reference frame has a finite energy on a list that holds it."""
        if sp.index not in sp.fns.checked:
            # the simulator's state: before the first run a trajectory has no
            # snapshots yet (checking those let NPT through, issue 37)
            if is_npt(trajs[0].sim_state):
                raise ValueError(f"State point {sp.name}: RelativeEntropy assumes a fixed box "
                                 f"(NVT); the simulator gives NPT states. Use an NVT simulator "
                                 f"such as jax_md.simulate.nvt_langevin.")
            R = sp.data.take(np.arange(1))
            check_frame_scale(sp.name, np.asarray(R)[0], np.asarray(sp.reference)[0])
            check_reference_energies(sp.name, self._all_reference_energies(sp),
                                     float(np.asarray(sp.state_kwargs["kT"])))
        super()._preflight(sp, trajs)

    def _all_reference_energies(self, sp, chunk: int = 256) -> np.ndarray:
        """The initial model's energy of every reference frame (once per
        state point, in chunks of one compiled size)."""
        size = min(chunk, sp.data.n)
        out = []
        for start in range(0, sp.data.n, size):
            rows = np.arange(start, min(start + size, sp.data.n))
            padded = np.concatenate([rows, np.full(size - len(rows), rows[0])])
            R = sp.data.take(padded)
            U = self._on_reference_frames(sp, R, lambda nbrs: sp.fns.reference_energies(
                self.params, R, nbrs, sp.state_kwargs))
            out.append(np.asarray(U, np.float64)[:len(rows)])
        return np.concatenate(out)

    @collective
    def plot(self, path: str) -> None:
        """Plot the estimated relative-entropy change, the gradient norm and
        N_eff / N per update into ``path``."""
        on_root(self.strategy, lambda: plot_history(self.history, path), only_root=True)


def _norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(tree)))


def check_reference_energies(name, U: np.ndarray, kT: float) -> None:
    """Refuse reference frames whose energy under the initial model is not
    finite, or so far above the others (more than 1,000 kT and 50 robust
    standard deviations above the median) that they cannot belong to an
    equilibrium ensemble: one frame with overlapping particles gives a
    gradient that overflows the optimizer's moments, after which training
    silently stops moving (issue 37)."""
    bad = np.flatnonzero(~np.isfinite(U))
    if len(bad):
        raise ValueError(f"State point {name}: the energy of reference frame(s) "
                         f"{bad[:5].tolist()} is {U[bad[0]]}; check that reference_data uses the "
                         f"model's units (nm) and box, and remove broken frames.")
    med = float(np.median(U))
    spread = 1.4826 * float(np.median(np.abs(U - med)))
    high = np.flatnonzero(U - med > max(50.0 * spread, 1000.0 * kT))
    if len(high):
        shown = ", ".join(f"{int(i)} ({U[i]:.4g})" for i in high[:5])
        raise ValueError(f"State point {name}: reference frame(s) {shown} have energies (kJ/mol) "
                         f"far above the others (median {med:.4g}, kT {kT:.4g}): overlapping "
                         f"particles or a broken frame? Such a frame's gradient overflows the "
                         f"optimizer. Remove it from reference_data.")


def plot_history(history, path: str) -> None:
    """Three panels over the updates of ``history``: each state point's
    relative-entropy change, the norm of the mean gradient, N_eff / N."""
    from matplotlib.figure import Figure
    if not history:
        raise RuntimeError("Nothing to plot yet: train first.")
    fig = Figure(figsize=(12.0, 3.2), constrained_layout=True)
    ax_s, ax_g, ax_n = fig.subplots(1, 3)
    by_sp: dict = {}
    for epoch in history:
        for r in epoch["statepoints"]:
            by_sp.setdefault(r["statepoint"], []).append(r)
    for i, rows in sorted(by_sp.items()):
        x = [r["update"] for r in rows]
        ax_s.plot(x, [r["loss"] for r in rows], label=f"state point {i}")
        ax_n.plot(x, [r["n_eff"] / r["n_snapshots"] for r in rows], label=f"state point {i}")
    norms = [n for epoch in history for n in epoch.get("grad_norms", [])]
    ax_g.semilogy(range(len(norms)), norms)
    for ax, label in ((ax_s, "S_rel - S_rel(initial)"), (ax_g, "gradient norm"),
                      (ax_n, "N_eff / N")):
        ax.set_xlabel("update")
        ax.set_ylabel(label)
    ax_s.legend(fontsize=7)
    fig.savefig(path, dpi=110)


#: reference frames spanning more than this many times the simulation's
#: reference state (or less than its inverse) are refused as in other units
FRAME_SCALE_LIMIT = 4.0


def check_frame_scale(name, frame, reference_state) -> None:
    """Refuse a reference frame whose positions span a region of another size
    than the simulation's reference state (largest extent over the
    dimensions): frames in Angstrom for a model in nm span 10 times as much,
    and the minimum image would fold their bonds silently."""
    span = float(np.max(np.ptp(frame, axis=0)))
    own = float(np.max(np.ptp(reference_state, axis=0)))
    if own > 0 and span > 0 and not 1 / FRAME_SCALE_LIMIT <= span / own <= FRAME_SCALE_LIMIT:
        raise ValueError(f"State point {name}: reference frame 0 spans {span:.4g} (largest extent "
                         f"of its positions) where the simulation's reference state spans "
                         f"{own:.4g}, {span / own:.3g} times as much. Pass reference frames in "
                         f"the model's units and coordinates (nm; Angstrom are 10 times larger; "
                         f"fractional coordinates if the simulation uses them).")

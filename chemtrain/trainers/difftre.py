"""DiffTRe trainers (upstream chemtrain's names): ``DifftreParallel`` takes
the state points as a batch with a leading axis, ``Difftre`` adds them one by
one with ``add_statepoint``. Both are the loop of
:class:`chemtrain.trainers.Reweighting` with DiffTRe's objective
(:func:`chemtrain.learn.difftre_objective`) and differ only in how state
points are declared.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from ..learn.reweighting import resolve_observables
from ..learn.difftre_batches import statepoint_batches
from ..learn.difftre_objective import difftre_objective
from ..learn.reuse import ReuseRule
from ..learn.statepoint import simulation_functions, statepoint_inputs
from ..learn.update import StepSizeSearch
from ..simulate.restart import RestartPolicy
from .options import RunOptions, run_options
from .reweighting import Reweighting
from .reweighting_update import with_ratio
from .services import collective

log = logging.getLogger("chemtrain")


class DifftreParallel(Reweighting):
    """DiffTRe over a batch of state points that share one potential,
    simulator and set of observables.

    Args:
      key: JAX random key; trajectory keys derive from it, the state point
        and the update count only.
      init_params: initial parameter pytree.
      optimizer: an ``optax.GradientTransformation`` (without
        ``chemtrain.learn.ema`` or ``reduce_on_plateau``, which only force
        matching feeds: refused).
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``.
      simulator_template: ``energy_fn -> (init, apply)``, a partial of a
        jax-md simulator.
      neighbor_fn: jax-md neighbor-list functions.
      timings: :func:`chemtrain.simulate.process_printouts` of one trajectory.
      state_kwargs: dict of arrays with one leading entry per state point;
        ``kT`` required, ``pressure`` for NPT, ``mass``/``box`` as the
        simulator needs.
      quantities: ``{name: fn(state, neighbor=, energy_fn=, **state_kwargs)}``.
      targets: ``{name: {'target': (n_statepoints, ...), 'gamma': w,
        'loss_fn': optional fn(pred, target)}}``.
      observables: ``{name: fn(quantity_trajs, weights)}``; a target named
        like a quantity defaults to its weighted mean.
      reference_states: initial positions, (n_statepoints, N, dim) or
        (n_statepoints, chains, N, dim) for several chains per state point.
      sim_batch_size: state points per update (-1: all); a remainder joins
        the last batch. Under MPI each update's state points are split over
        the ranks (at least one each); gradients are summed over ranks and
        divided by the update's number of state points.
      parallelism: 'auto' (one process: 'single'; several MPI ranks: 'mpi'),
        'single' or 'mpi' (one rank per device; every rank constructs the
        trainer with the same data and calls the same methods in the same
        order; recomputed trajectories are sent to every rank).
      reweight_ratio: recompute a trajectory when N_eff < ratio x N
        (upstream's keyword; or ``reuse.reweight_ratio``; default 0.9).
      reuse: the reuse rule, a :class:`~chemtrain.learn.ReuseRule` (None:
        its defaults). By default each state point reweights from a
        pool of its recent trajectories (:mod:`chemtrain.learn.pool`) as
        large as costs about half a recompute per update (at most 20, from
        the step counts; 1 for trajectories of few steps per snapshot), so
        no one trajectory's sampling error is fitted, and recomputes when no
        trajectory of the pool keeps ``N_eff >= reweight_ratio * N`` or
        after ``max_reuses=4`` reuses. ``ReuseRule(pool=1,
        max_reuse_se=None, max_reuses=None)`` is upstream chemtrain's rule.
      loss_fn: ``fn(predictions, targets) -> loss`` replacing the gamma-
        weighted sum of per-target losses.
      step_size_search: a :class:`~chemtrain.learn.StepSizeSearch`
        (``candidates``, ``allowed_reduction``): each update is scaled down
        (1, 1/2, 1/4, ...) until N_eff keeps ``allowed_reduction`` of its
        value at every state point; True: its defaults (10 candidates, 0.5);
        None: no search.
      restart: the :class:`~chemtrain.simulate.RestartPolicy`
        (``capacity_multiplier``, ``max_retries``) of neighbor-list
        overflows (:func:`chemtrain.simulate.run_with_restart`); None: its
        defaults (1.5, 3).
      vmap_batch: snapshots evaluated at once in the loss.
      checkpoint_path: folder of checkpoints and ``<name>_error_state.npz``
        (upstream's keyword, or ``options.checkpoint_path``).
      options: a :class:`~chemtrain.trainers.RunOptions`: ``log_file``
        (JSON-lines metrics, one line per epoch), ``plot_file`` (the plot of
        predictions against targets at the end of :meth:`train`; ``plot_x``
        gives x values of array observables, e.g. ``{'rdf': bin_centers}``),
        ``progress``, ``consistency_check_every`` (updates between checks
        that the replicas agree), ``name`` (of ``<name>_error_state.npz``;
        default ``"difftre"``) and ``on_update``, an ``fn(record)`` called
        on every process after each applied update, with ``record`` a dict:
        ``update`` (its index), ``epoch``, ``batch`` (the state points),
        ``params_before``, ``params_after``, ``loss``, ``step_size`` and
        ``statepoints`` (state point -> the per-state-point record of the
        epoch's ``history``: loss, parts, N_eff, the pool's largest N_eff
        ``pool_n_eff``, recomputed, predictions, targets).

    Attributes after training: ``params``, ``opt_state``, ``trajstates``
    (state point -> list of :class:`chemtrain.simulate.TrajState`, one per
    chain), ``predictions`` (state point -> latest observables),
    ``history`` (one record per epoch, as in ``log_file``),
    ``epoch_losses``, ``update_losses``, ``epoch``, ``update_count``.
    Quantities that never call the energy function they are given (RDF,
    ADF, density) are evaluated once per trajectory; the others (pressure,
    energy) in every update, under the current parameters.
    """

    trainer_name, default_name = "DifftreParallel", "difftre"

    def __init__(self, key, init_params, optimizer, energy_fn_template: Callable,
                 simulator_template: Callable, neighbor_fn, timings, state_kwargs: Mapping,
                 quantities: Mapping, targets: Mapping, observables: Mapping | None = None, *,
                 reference_states=None, loss_fn: Callable | None = None,
                 vmap_batch: int | None = 10, sim_batch_size: int = 1,
                 reweight_ratio: float | None = None, parallelism: str = "auto",
                 reuse: ReuseRule | None = None,
                 step_size_search: StepSizeSearch | bool | None = None,
                 restart: RestartPolicy | None = None, checkpoint_path: str | None = None,
                 options: RunOptions | None = None):
        n = _check_batch_inputs(state_kwargs, targets, reference_states)
        resolve_observables(targets, quantities, observables)
        statepoint_batches(n, sim_batch_size)
        super().__init__(
            difftre_objective(), key, init_params, optimizer, sim_batch_size=sim_batch_size,
            parallelism=parallelism, reuse=with_ratio(reuse, reweight_ratio),
            step_size_search=step_size_search, restart=restart,
            options=run_options(options, self.trainer_name, self.OPTIONS,
                                checkpoint_path=checkpoint_path))
        with self.strategy.failure_guard():
            specs = {k: {kk: vv for kk, vv in v.items() if kk != "target"}
                     for k, v in targets.items()}
            fns = simulation_functions(energy_fn_template, simulator_template, neighbor_fn,
                                       timings, vmap_batch)
            spec = {"quantities": quantities, "targets": specs, "observables": observables,
                    "loss_fn": loss_fn, "vmap_batch": vmap_batch}
            reference, first = jnp.asarray(reference_states), None
            for i in range(n):   # one compiled set of functions for all
                sp = self._append(fns, {k: np.asarray(v)[i] for k, v in state_kwargs.items()},
                                  reference[i], specs, {k: np.asarray(v["target"])[i]
                                                        for k, v in targets.items()},
                                  timings.n_snapshots, spec=spec, like=first)
                first = first or sp
            self._check_statepoints("construction")
            self.batches()  # enough state points for the ranks
        if self.strategy.is_root:
            log.info("DifftreParallel: %d state point(s), %s", n, self.strategy.describe())


def _check_batch_inputs(state_kwargs, targets, reference_states) -> int:
    """Number of state points; every leading axis must agree."""
    if not isinstance(state_kwargs, Mapping) or "kT" not in state_kwargs:
        got = (sorted(state_kwargs) if isinstance(state_kwargs, Mapping)
               else type(state_kwargs).__name__)
        raise ValueError(f"state_kwargs must be a dict with 'kT' (thermal energy in kJ/mol, one "
                         f"value per state point, e.g. [chemtrain.units.kT(300.0)]); got {got}.")
    if reference_states is None:
        raise ValueError("reference_states (initial positions, one per state point: shape "
                         "(n_statepoints, N, dim) or (n_statepoints, chains, N, dim)) is required.")
    axes = {f"state_kwargs[{k!r}]": np.shape(v) for k, v in state_kwargs.items()}
    axes.update({f"targets[{k!r}]['target']": np.shape(v["target"])
                 for k, v in targets.items() if isinstance(v, Mapping) and "target" in v})
    axes["reference_states"] = np.shape(reference_states)
    kT_shape = np.shape(state_kwargs["kT"])
    if len(kT_shape) != 1 or kT_shape[0] < 1:
        raise ValueError(f"state_kwargs['kT'] must have one value per state point (a 1-D array), "
                         f"got shape {kT_shape}.")
    n = kT_shape[0]
    bad = {k: s for k, s in axes.items() if not s or s[0] != n}
    if bad:
        listing = ", ".join(f"{k}: {s}" for k, s in bad.items())
        raise ValueError(f"state_kwargs, targets and reference_states need the same leading "
                         f"(state-point) axis: kT has {n} state point(s), but {listing}. Give "
                         f"every entry one row per state point (np.broadcast_to for shared "
                         f"values).")
    if len(axes["reference_states"]) not in (3, 4):
        raise ValueError(f"reference_states must have shape (n_statepoints, N, dim) or "
                         f"(n_statepoints, chains, N, dim), got {axes['reference_states']}.")
    return int(n)


class Difftre(Reweighting):
    """DiffTRe with state points added one by one (upstream chemtrain's style).

    Each state point has its own potential template, simulator, timings and
    targets. Build the trainer with ``Difftre(init_params, optimizer,
    reweight_ratio=0.9, sim_batch_size=1)``, then call :meth:`add_statepoint`
    once per state point and :meth:`train`. The arguments that
    :class:`DifftreParallel` shares mean what they mean there; the entries
    below say so briefly. Units are chemtrain's: nm, kJ/mol, ps, amu.

    Args:
      init_params: initial parameter pytree (floating-point arrays).
      optimizer: an ``optax.GradientTransformation`` (without
        ``chemtrain.learn.ema`` or ``reduce_on_plateau``, which only force
        matching feeds: refused).
      reweight_ratio: recompute a trajectory when N_eff < ratio x N, a number
        in [0, 1] (None: ``reuse.reweight_ratio``, default 0.9); as in
        :class:`DifftreParallel`.
      sim_batch_size: state points per update (-1: all); a remainder joins
        the last batch. It must not exceed the number of state points once
        training starts, and under MPI it must be at least the number of
        ranks; as in :class:`DifftreParallel`.
      energy_fn_template: default ``params -> energy_fn(R, neighbor,
        **kwargs)`` for state points added without a template of their own
        (None: every :meth:`add_statepoint` must give one).
      key: JAX random key, or an integer seed, from which the trajectory keys
        derive; None means ``PRNGKey(0)``.
      loss_fn: default ``fn(predictions, targets) -> loss`` for state points
        added without one (None: the gamma-weighted sum of per-target losses).
      parallelism: 'auto', 'single' or 'mpi'; as in :class:`DifftreParallel`.
      reuse: a :class:`~chemtrain.learn.ReuseRule` or None; as in
        :class:`DifftreParallel`.
      step_size_search: a :class:`~chemtrain.learn.StepSizeSearch`
        (``candidates``, ``allowed_reduction``): each update is scaled down
        (1, 1/2, 1/4, ...) until N_eff keeps ``allowed_reduction`` of its
        value at every state point; True: its defaults (10 candidates, 0.5);
        None: no search.
      restart: the :class:`~chemtrain.simulate.RestartPolicy`
        (``capacity_multiplier``, ``max_retries``) of neighbor-list
        overflows (:func:`chemtrain.simulate.run_with_restart`); None: its
        defaults (1.5, 3).
      checkpoint_path: folder of the epoch checkpoints and of
        ``<name>_error_state.npz`` (upstream's keyword, or
        ``options.checkpoint_path``).
      options: a :class:`~chemtrain.trainers.RunOptions` (``log_file``,
        ``plot_file``, ``plot_x``, ``progress``, ``consistency_check_every``,
        ``name``, ``on_update``); as in :class:`DifftreParallel`.

    Attributes:
      params: the current parameters.
      opt_state: the optimizer state.
      trajstates: state point -> list of :class:`chemtrain.simulate.TrajState`,
        one per chain.
      predictions: state point -> its latest observables.
      history: one record per epoch, as written to ``log_file``.
      epoch_losses: the loss of every epoch.
      update_losses: the loss of every update.
      epoch: epochs trained so far.
      update_count: updates applied so far.
      statepoints: the :class:`~chemtrain.learn.StatePoint` objects, in the
        order they were added.

    Raises:
      ValueError: if ``reweight_ratio`` or ``sim_batch_size`` is out of
        range, if ``sim_batch_size`` is smaller than the number of MPI
        ranks, if ``parallelism`` is unknown or asks for JAX sharding (also
        when ``jax.distributed`` runs several processes), if ``init_params``
        holds no arrays, or if ``log_file`` is a folder.
      TypeError: if ``optimizer`` is not an ``optax.GradientTransformation``,
        ``on_update`` is not callable, ``key`` is neither a seed nor a JAX
        key, a leaf of ``init_params`` is not floating point, or ``log_file``
        is not a path.
    """

    trainer_name, default_name = "Difftre", "difftre"

    def __init__(self, init_params, optimizer, reweight_ratio: float | None = None,
                 sim_batch_size: int = 1, energy_fn_template: Callable | None = None, *,
                 key=None, loss_fn: Callable | None = None, parallelism: str = "auto",
                 reuse: ReuseRule | None = None,
                 step_size_search: StepSizeSearch | bool | None = None,
                 restart: RestartPolicy | None = None, checkpoint_path: str | None = None,
                 options: RunOptions | None = None):
        self.energy_fn_template = energy_fn_template
        self._default_loss_fn = loss_fn
        super().__init__(
            difftre_objective(), key, init_params, optimizer, sim_batch_size=sim_batch_size,
            parallelism=parallelism, reuse=with_ratio(reuse, reweight_ratio),
            step_size_search=step_size_search, restart=restart,
            options=run_options(options, self.trainer_name, self.OPTIONS,
                                checkpoint_path=checkpoint_path))

    @collective
    def add_statepoint(self, energy_fn_template, simulator_template, neighbor_fn, timings,
                       state_kwargs, quantities, reference_state, targets=None, observables=None,
                       loss_fn=None, vmap_batch: int | None = 10, initialize_traj: bool = True):
        """Add one state point. ``state_kwargs``: dict of this state point's
        values (``kT`` required) or a number (kT). ``reference_state``:
        positions (N, dim), several chains (chains, N, dim), or upstream's
        ``(simulator_state, nbrs)``. ``targets``: ``{name: {'target': array,
        'gamma': w}}``. With ``initialize_traj`` its first trajectory is
        sampled now (else call :meth:`initialize_trajstates`). Each state
        point added here compiles its own functions; state points that share
        everything but ``state_kwargs`` and targets are cheaper as one
        :class:`DifftreParallel`. Returns the state point's index."""
        state_kwargs, reference_state = statepoint_inputs(state_kwargs, reference_state)
        targets = targets or {}
        resolve_observables(targets, quantities, observables)
        specs = {k: {kk: vv for kk, vv in v.items() if kk != "target"} for k, v in targets.items()}
        energy_fn_template = energy_fn_template or self.energy_fn_template
        if energy_fn_template is None:
            raise ValueError("add_statepoint needs an energy_fn_template (or give one to the "
                             "trainer).")
        fns = simulation_functions(energy_fn_template, simulator_template, neighbor_fn, timings,
                                   vmap_batch)
        spec = {"quantities": quantities, "targets": specs, "observables": observables,
                "loss_fn": loss_fn or self._default_loss_fn, "vmap_batch": vmap_batch}
        first = self.statepoints[0] if self.statepoints else None
        if first is not None and sorted(first.targets) != sorted(specs):
            raise ValueError(f"Every state point needs the same target names; the first has "
                             f"{sorted(first.targets)}, this one {sorted(specs)}.")
        sp = self.add(fns, state_kwargs, reference_state, specs,
                      {k: v["target"] for k, v in targets.items()}, timings.n_snapshots,
                      spec=spec)
        if initialize_traj:
            self.initialize_trajstates(1, statepoints=[sp.index])
        return sp.index


"""``RelativeEntropy`` (upstream chemtrain's name): relative-entropy
minimisation of a (coarse-grained) potential against mapped reference
configurations: the loop of :class:`~chemtrain.trainers.Reweighting` with
the objective of :func:`chemtrain.learn.relative_entropy_objective`.

It shares everything with DiffTRe but the objective: the
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

from typing import Callable

from ..learn.reference_frames import ReferenceFrames
from ..learn.reuse import ReuseRule
from ..learn.relative_entropy import relative_entropy_objective
from ..learn.statepoint import simulation_functions, statepoint_inputs
from ..learn.update import StepSizeSearch
from ..simulate.restart import RestartPolicy
from .options import RunOptions, run_options
from .reweighting import Reweighting
from .reweighting_update import with_ratio
from .services import collective

__all__ = ["RelativeEntropy", "ReferenceFrames"]


class RelativeEntropy(Reweighting):
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
      optimizer: an ``optax.GradientTransformation`` (without
        ``chemtrain.learn.ema`` or ``reduce_on_plateau``, which only force
        matching feeds: refused).
      reweight_ratio: recompute a trajectory when N_eff < ratio x N, a number
        in [0, 1] (None: ``reuse.reweight_ratio``, default 0.9).
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
      reuse: a :class:`~chemtrain.learn.ReuseRule` (``max_reuse_se``,
        ``max_reuses``) or None (its defaults); relative entropy reweights
        one trajectory per state point, so its ``pool`` must be 1 or None.
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
      options: a :class:`~chemtrain.trainers.RunOptions`: ``log_file``,
        ``plot_file`` (the plot of :meth:`plot` at the end of :meth:`train`:
        relative-entropy change, gradient norm and N_eff / N per update),
        ``progress``, ``consistency_check_every``, ``name`` (default
        ``"relentropy"``) and ``on_update`` (the record is as in
        :class:`DifftreParallel`, with the per-state-point records of the
        history above). Relative-entropy state points have no targets, so a
        non-empty ``plot_x`` is refused when a state point is added.

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
      statepoints: the :class:`~chemtrain.learn.StatePoint` objects, in the
        order they were added; each one's ``data`` holds its reference
        configurations.

    Raises:
      ValueError: if ``reweight_ratio`` or ``sim_batch_size`` is out of
        range, if ``reuse`` asks for a pool, if ``sim_batch_size`` is smaller
        than the number of MPI ranks, if ``parallelism`` is unknown or asks for JAX sharding (also
        when ``jax.distributed`` runs several processes), if ``init_params``
        holds no arrays, or if ``log_file`` is a folder.
      TypeError: if ``optimizer`` is not an ``optax.GradientTransformation``,
        ``on_update`` is not callable, ``key`` is neither a seed nor a JAX
        key, a leaf of ``init_params`` is not floating point, or ``log_file``
        is not a path.
    """

    trainer_name, default_name = "RelativeEntropy", "relentropy"

    def __init__(self, init_params, optimizer, reweight_ratio: float | None = None,
                 sim_batch_size: int = 1, energy_fn_template: Callable | None = None, *,
                 key=None, parallelism: str = "auto",
                 reuse: ReuseRule | None = None,
                 step_size_search: StepSizeSearch | bool | None = None,
                 restart: RestartPolicy | None = None, checkpoint_path: str | None = None,
                 options: RunOptions | None = None):
        self.energy_fn_template = energy_fn_template
        super().__init__(
            relative_entropy_objective(), key, init_params, optimizer,
            sim_batch_size=sim_batch_size, parallelism=parallelism,
            reuse=with_ratio(reuse, reweight_ratio),
            step_size_search=step_size_search, restart=restart,
            options=run_options(options, self.trainer_name, self.OPTIONS,
                                checkpoint_path=checkpoint_path))

    @property
    def s_rel(self) -> list:
        """Per state point, the estimated change of the relative entropy since
        the initial parameters (the running sum of every update's estimate,
        the objective's state)."""
        return [st["s_rel"] for st in self.state.objective_state]

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
        data = ReferenceFrames(reference_data, reference_state, reference_batch_size,
                               f"State point {index}", neighbor_fn)
        fns = simulation_functions(template, simulator_template, neighbor_fn, timings,
                                   vmap_batch)
        sp = self.add(fns, state_kwargs, reference_state, n_snapshots=timings.n_snapshots,
                      data=data, spec={"vmap_batch": vmap_batch})
        if initialize_traj:
            self.initialize_trajstates(1, statepoints=[sp.index])
        return sp.index

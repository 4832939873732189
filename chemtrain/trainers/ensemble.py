"""``EnsembleOfModels`` (upstream chemtrain's name): a committee of K models of
one energy template trained by force matching in one vectorised step.

The members' parameters are stacked along a leading axis and every optax
transformation is applied to each member separately
(:func:`chemtrain.learn.ensemble.vectorized`), so one compiled step updates
all K; each member draws its own order of the training set (and, with
``bootstrap``, its own bootstrap sample of it,
:mod:`chemtrain.data.members`). Everything else is
:class:`~chemtrain.trainers.ForceMatching`'s: the parallel methods (the
batch's rows are split over devices or ranks as for one model), data,
checkpoints, resume and failures.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import optax

from ..data.members import bootstrap_indices
from ..learn import ensemble as ens
from .force_matching import ForceMatching
from .options import RunOptions

__all__ = ["EnsembleOfModels"]


class EnsembleOfModels(ForceMatching):
    """A committee of K models trained together by force matching.

    Member ``k`` starts from ``init_params[k]`` and sees the batches a single
    ``ForceMatching(init_params[k], ..., seed=seed + k)`` would see on the
    same training set (with ``bootstrap``, on its bootstrap sample
    :meth:`bootstrap_sample`), so a member trained here equals that run.
    Validation and test metrics are the committee's (the members' mean
    prediction) with ``members``, each member's; ``predict`` gives the mean,
    the spread over members and each member's prediction.

    Args:
      init_params: a list of K >= 2 parameter pytrees of one structure (e.g.
        the template's initialiser with K keys), or a pytree whose leaves
        stack the K members on axis 0 (``chemtrain.learn.ensemble.as_stacked``).
      optimizer: an ``optax.GradientTransformation``; each member gets its own
        state.
      energy_fn_template: as in :class:`ForceMatching` (one member's).
      nbrs_init: as in :class:`ForceMatching`.
      bootstrap: train member ``k`` on its own bootstrap sample of the
        training set (``n`` structures drawn with replacement, seeded by
        ``seed + k``) instead of the whole set.
      batch: global structures per step and member, divisible by the number
        of shards.
      parallelism: 'auto', 'single', 'jax' or 'mpi', as in
        :class:`ForceMatching`; the rows of a step are split, each row
        holding one structure per member.
      mesh: optional 1-D mesh with axis 'data' for 'jax'.
      gammas: loss weight per target, as in :class:`ForceMatching`.
      weights_keys: per-structure weights, as in :class:`ForceMatching`.
      checkpoint_path: folder for checkpoints and error states.
      log_file: JSON-lines metrics file, or None: one line per epoch with
        the committee's validation metrics (``val``), each member's training
        loss (``members``) and validation metrics (``val_members``).
      seed: member ``k`` orders its batches with ``seed + k``.
      check_vma: as in :class:`ForceMatching`.
      losses: per-target losses, as in :class:`ForceMatching`.
      options: a :class:`~chemtrain.trainers.RunOptions`, as in
        :class:`ForceMatching`; an ``epoch_line``'s record has the
        committee's ``val`` metrics.

    Raises:
      ValueError: fewer than two members, or members of different
        structures, shapes or dtypes (named); and everything
        :class:`ForceMatching` raises.
      TypeError: a training loader that is not in memory, at ``train``.
    """

    def __init__(self, init_params, optimizer: optax.GradientTransformation,
                 energy_fn_template, nbrs_init, *, bootstrap: bool = False,
                 batch: int | None = None, parallelism: str = "auto", mesh=None,
                 gammas: Mapping[str, float] | None = None, weights_keys: Mapping | None = None,
                 checkpoint_path: str | None = None, log_file: str | None = None,
                 seed: int = 0, check_vma: bool | None = None, losses: Mapping | None = None,
                 options: RunOptions | None = None):
        stacked = ens.as_stacked(init_params)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got "
                            f"{type(optimizer).__name__}.")
        self.n_members, self.bootstrap = ens.n_members(stacked), bool(bootstrap)
        super().__init__(stacked, ens.vectorized(optimizer), energy_fn_template, nbrs_init,
                         batch=batch, parallelism=parallelism, mesh=mesh, gammas=gammas,
                         weights_keys=weights_keys, checkpoint_path=checkpoint_path,
                         log_file=log_file, seed=seed, check_vma=check_vma, losses=losses,
                         options=options,
                         functions=ens.trainer_functions(self.n_members, self.bootstrap))

    def _resume_settings(self) -> dict:
        # the members' data: a resume that switched bootstrap would change it mid-run
        return {**super()._resume_settings(), "bootstrap": self.bootstrap}

    def member(self, k: int):
        """Member ``k``'s parameters (host numpy), e.g. to export it: its
        moving average when the optimizer keeps one (``eval_params``).

        Raises:
          IndexError: ``k`` is not in ``range(n_members)``.
        """
        if not (isinstance(k, (int, np.integer)) and 0 <= k < self.n_members):
            raise IndexError(f"member {k!r}: this committee has members 0 to "
                             f"{self.n_members - 1}.")
        return ens.member_params(self.strategy.to_host(self.eval_params), int(k))

    def bootstrap_sample(self, k: int) -> np.ndarray | None:
        """The training-set rows member ``k`` trains on (with repeats), or
        None without ``bootstrap``. Needs the training set."""
        if not self.bootstrap:
            return None
        return bootstrap_indices(self.data["training"].n, self.seed, int(k))

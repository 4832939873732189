"""A trainer's resumable state as one frozen structure.

Each trainer keeps everything a run needs to continue in one
:class:`TrainerState` (``FMState`` for force matching, ``ReweightingState`` for
DiffTRe): a frozen dataclass that is also a JAX pytree. Its array fields,
named in ``TREES`` (parameters, optimizer state, ...), are the pytree's
children; all other fields are plain data (numbers, strings, lists and dicts
of them) and travel as the pytree's static part, except the logs named in
``LOGS`` (histories, losses per epoch), which grow every epoch: they travel
beside the structure (:class:`Logs`, equal to any other), so the tree
structure of a state stays the same over training. So
``jax.tree.map(np.asarray, state)`` copies the arrays and keeps the
bookkeeping, and a checkpoint is exactly :meth:`TrainerState.split`'s two
parts: nothing is copied attribute by attribute, and a field added to a
state class is in every checkpoint without further code.

Trainers never mutate a state; an update builds the next one with
:meth:`TrainerState.replace`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Mapping

import jax
import numpy as np

from ..parallel.failures import agree


def _plain(value, where: str):
    """``value`` as JSON-able plain data (tuples become lists), or TypeError."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise TypeError(f"{where} must be plain data (numbers, strings, lists, dicts), got "
                    f"{type(value).__name__}.")


class TrainerState:
    """Base of the frozen state classes: subclass with
    ``@dataclasses.dataclass(frozen=True)`` and name the array fields in
    ``TREES``; every other field must hold plain data."""

    TREES: ClassVar[tuple[str, ...]] = ()
    LOGS: ClassVar[tuple[str, ...]] = ()   # plain fields that grow: not part of the structure
    ADDED: ClassVar[dict] = {}   # plain field -> factory of its value where a file lacks it
    RENAMED: ClassVar[dict] = {}   # plain field -> (older field, conversion) where a file has that

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(
            cls, lambda s: s._flatten_with_keys(), lambda aux, kids: cls._unflatten(aux, kids),
            lambda s: s._flatten())

    # -- the two parts ------------------------------------------------------
    @classmethod
    def plain_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.TREES)

    def split(self) -> tuple[dict, dict]:
        """(trees, plain): the array fields as a dict of pytrees and the other
        fields as JSON-able plain data (a checkpoint's two parts)."""
        values = {f.name: self.__dict__[f.name] for f in dataclasses.fields(self)}
        trees = {name: values[name] for name in self.TREES}
        plain = {name: _plain(values[name], f"{type(self).__name__}.{name}")
                 for name in self.plain_fields()}
        return trees, plain

    @classmethod
    def join(cls, trees: Mapping[str, Any], plain: Mapping[str, Any]):
        """The state made of :meth:`split`'s two parts (lists stay lists);
        fields of older versions (``RENAMED``) are converted."""
        plain = {**{new: convert(plain[old]) for new, (old, convert) in cls.RENAMED.items()
                    if new not in plain and old in plain}, **plain}
        plain = {**{n: make() for n, make in cls.ADDED.items() if n not in plain}, **plain}
        missing = [n for n in (*cls.TREES, *cls.plain_fields())
                   if n not in (trees if n in cls.TREES else plain)]
        if missing:
            raise KeyError(f"{cls.__name__} needs {missing}.")
        return cls(**{n: trees[n] for n in cls.TREES},
                   **{n: plain[n] for n in cls.plain_fields()})

    def replace(self, **changes):
        """A copy with ``changes`` (the state itself never changes)."""
        return dataclasses.replace(self, **changes)

    # -- pytree -------------------------------------------------------------
    def _aux(self):
        # the static part as canonical JSON (hashable, compared by value), and
        # the logs beside it, outside the structure's comparison
        static = {n: _plain(self.__dict__[n], f"{type(self).__name__}.{n}")
                  for n in self.plain_fields() if n not in self.LOGS}
        return (json.dumps(static, sort_keys=True, allow_nan=True),
                Logs({n: self.__dict__[n] for n in self.LOGS}))

    def _flatten(self):
        return tuple(self.__dict__[n] for n in self.TREES), self._aux()

    def _flatten_with_keys(self):
        return (tuple((jax.tree_util.GetAttrKey(n), self.__dict__[n]) for n in self.TREES),
                self._aux())

    @classmethod
    def _unflatten(cls, aux, children):
        static, logs = aux
        return cls.join(dict(zip(cls.TREES, children)), {**json.loads(static), **logs.values})


class Logs:
    """The growing plain fields of a state (histories, per-epoch losses) as
    they travel with its pytree structure: carried along by tree maps, but
    equal to any other ``Logs``, so that a state's structure does not change
    as training appends to them."""

    __slots__ = ("values",)

    def __init__(self, values: dict):
        self.values = values

    def __eq__(self, other):
        return isinstance(other, Logs)

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"Logs({sorted(self.values)})"


@dataclasses.dataclass(frozen=True)
class FMState(TrainerState):
    """What a :class:`~chemtrain.trainers.ForceMatching` run continues from.

    A frozen dataclass and JAX pytree (see :class:`TrainerState`): the
    parameters, the optimizer state and the best parameters so far are its
    arrays; epoch and step counts, the batch-order seed, the best monitored
    loss and the per-epoch histories are plain data.

    Attributes:
      params: the current parameters (pytree).
      opt_state: the optimizer state (pytree).
      best_params: host (numpy) copy of the parameters with the lowest
        monitored loss so far (the initial parameters before the first
        epoch).
      epoch: epochs trained so far.
      step: optimizer steps applied so far.
      seed: the seed of the batch order (a restored trainer reseeds its
        loaders with it).
      best_loss: the lowest monitored loss so far (the validation loss when
        there is a validation set, else the training loss); ``inf`` before
        the first epoch.
      train_losses: the mean training loss of every epoch.
      val_losses: the validation loss of every epoch (empty without a
        validation set).
      history: one record per epoch, as written to the trainer's
        ``log_file``.
      best_epoch: the epoch (from 0) whose parameters are ``best_params``;
        -1 before the first epoch and in checkpoints of older versions.
    """

    TREES: ClassVar[tuple[str, ...]] = ("params", "opt_state", "best_params")
    LOGS: ClassVar[tuple[str, ...]] = ("train_losses", "val_losses", "history")
    ADDED: ClassVar[dict] = {"best_epoch": lambda: -1}   # absent from older checkpoints

    params: Any
    opt_state: Any
    best_params: Any
    epoch: int = 0
    step: int = 0
    seed: int = 0
    best_loss: float = math.inf
    train_losses: list = dataclasses.field(default_factory=list)
    val_losses: list = dataclasses.field(default_factory=list)
    history: list = dataclasses.field(default_factory=list)
    best_epoch: int = -1


@dataclasses.dataclass(frozen=True)
class ReweightingState(TrainerState):
    """What a run of the reweighting loop (DiffTRe, relative entropy,
    dynamics, any :class:`~chemtrain.learn.Objective`) continues from.

    A frozen dataclass and JAX pytree (see :class:`TrainerState`): the
    parameters and the optimizer state are its arrays; the rest is plain
    data. The trajectory states, which a checkpoint holds as well, are kept
    beside it (their plain-data form is
    :mod:`chemtrain.trainers.difftre_io`'s).

    Attributes:
      params: the current parameters (pytree).
      opt_state: the optimizer state (pytree).
      epoch: epochs trained so far.
      update_count: updates applied so far.
      init_runs: ``num_runs`` of the last ``initialize_trajstates`` call
        (trajectories run in a row to start each state point).
      reuses: per state point, how many updates have reused its trajectory
        since it was sampled. Checkpoints of older versions lack it; it is
        then empty.
      objective_state: per state point, the objective's own state (plain
        data from :attr:`chemtrain.learn.Objective.init`; relative
        entropy: ``{"s_rel": ...}``, the estimated change of the relative
        entropy since the initial parameters). Empty in checkpoints of
        versions that kept none (filled from ``init``); relative entropy's
        older ``s_rel`` field is read into it.
      stopped: why the running epoch stopped: None after a completed epoch
        (every checkpoint), else ``["failed", update]``, ``["callback",
        update, error class name]`` or ``["interrupted", updates]`` (an
        error state says which).
      history: one record per epoch, as written to the trainer's
        ``log_file``.
      epoch_losses: the loss of every epoch (mean over state points).
      update_losses: the loss of every update.
    """

    TREES: ClassVar[tuple[str, ...]] = ("params", "opt_state")
    LOGS: ClassVar[tuple[str, ...]] = ("history", "epoch_losses", "update_losses")
    # absent from checkpoints of older versions
    ADDED: ClassVar[dict] = {"reuses": list, "objective_state": list, "stopped": lambda: None}
    # field -> (the older field it replaces, its conversion)
    RENAMED: ClassVar[dict] = {"objective_state": ("s_rel", lambda v: [{"s_rel": x} for x in v])}

    params: Any
    opt_state: Any
    epoch: int = 0
    update_count: int = 0
    init_runs: int = 0
    reuses: list = dataclasses.field(default_factory=list)
    objective_state: list = dataclasses.field(default_factory=list)
    stopped: Any = None
    history: list = dataclasses.field(default_factory=list)
    epoch_losses: list = dataclasses.field(default_factory=list)
    update_losses: list = dataclasses.field(default_factory=list)


def checked_params(strategy, current, params):
    """``params`` as host numpy (the root's values on every process), after
    checking on every process that they have the structure, shapes and
    dtypes of ``current`` (host numpy): how one trainer hands its parameters
    to another. A mismatch on any process raises on all of them before
    anything is sent (a broadcast of unequal structures could wait forever).
    Non-finite values are refused too: training from them could only fail
    later, blamed on something else."""
    def check():
        host = jax.tree.map(np.asarray, params)
        check_like(current, host, "the trainer's", "the new parameters")
        for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
            if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
                raise ValueError(f"The new parameters hold non-finite values (NaN or inf) in "
                                 f"{jax.tree_util.keystr(path)}; set finite parameters (the "
                                 f"trainer keeps its own).")
        return host
    return strategy.broadcast_from_root(agree(strategy, check, "checking the new parameters"))


def check_like(want, got, want_name: str, got_name: str) -> None:
    """Raise ValueError unless the parameters ``got`` have the pytree
    structure, shapes and dtypes of ``want``; the names say whose they are."""
    if jax.tree.structure(want) != jax.tree.structure(got):
        raise ValueError(f"{got_name} have another structure than {want_name}: "
                         f"{jax.tree.structure(got)} against {jax.tree.structure(want)}.")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        if np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype:
            raise ValueError(f"Parameter {jax.tree_util.keystr(path)}: expected shape "
                             f"{np.shape(a)} and dtype {np.asarray(a).dtype} ({want_name}), got "
                             f"{np.shape(b)} and {np.asarray(b).dtype} ({got_name}).")


class HoldsState:
    """The base of every trainer: its resumable state is ``self.state`` (a
    :class:`~.state.TrainerState`) whose arrays ``self.store`` (a
    :class:`CheckpointStore`) places. ``params`` reads it; setting it is how
    one trainer hands its parameters to another: checked on every process
    (:func:`checked_params`), the root's values placed."""

    @property
    def params(self):
        return self.state.params

    @params.setter
    def params(self, params) -> None:
        host = checked_params(self.store.strategy, self.store.to_host("params", self.state.params),
                              params)
        self.state = self.state.replace(params=self.store.place("params", host))


DifftreState = ReweightingState   # its name until this release, for code that imports it

"""The trajectories of a reweighting trainer's state points
(:class:`TrajectoryStore`): sampling with neighbor-list restarts
(:class:`~chemtrain.simulate.RestartPolicy`), what an objective derives
once per trajectory, the exchange of newly sampled trajectories between
processes and their plain-data files (:mod:`.difftre_io`)."""
from __future__ import annotations

from ..learn.difftre_batches import statepoint_key
from ..learn.pool import pooled
from ..parallel import on_root
from . import difftre_io


class TrajectoryStore:
    """State point -> its trajectory states (one
    :class:`~chemtrain.simulate.TrajState` per chain), on every process.

    Args:
      strategy: the trainer's parallel strategy (its communicator).
      restart: the :class:`~chemtrain.simulate.RestartPolicy` of every run.

    Attributes:
      states: state point -> list of trajectory states (its newest).
      older: state point -> its earlier trajectories, oldest first, as many
        as its pool keeps (``pools[i] - 1``; :mod:`chemtrain.learn.pool`).
      pools: state point -> its pool size (1 where not set).
      derived: state point -> the objective's ``derive`` of what it
        reweights from (dropped whenever that changes).
    """

    def __init__(self, strategy, restart):
        self.strategy, self.restart = strategy, restart
        self.states: dict[int, list] = {}
        self.older: dict[int, list] = {}
        self.pools: dict[int, int] = {}
        self.derived: dict[int, object] = {}
        self._views: dict[int, list] = {}
        self._parts: dict[int, tuple] = {}   # id(trajectory) -> (it, its derive)

    def put(self, new: dict, derived: dict | None = None) -> None:
        """Make ``new`` the newest trajectories of its state points; the ones
        they replace join the state point's pool (the oldest leave it).
        ``derived``: the objective's ``derive`` of the pools this gives, where
        already computed (state point -> value), so it is not computed again."""
        for i, trajs in new.items():
            keep = self.pools.get(i, 1) - 1
            if keep > 0 and i in self.states:
                self.older[i] = [*self.older.get(i, []), self.states[i]][-keep:]
            self.states[i] = trajs
            self.derived.pop(i, None)
            self._views.pop(i, None)
            if derived and i in derived:
                self.derived[i] = derived[i]
        self._forget_parts()

    def replace(self, new: dict, older: dict | None = None) -> None:
        """Set the trajectories (and pools: ``older``, default empty) of the
        state points in ``new``, e.g. fresh or loaded ones."""
        for i in new:
            keep, kept = self.pools.get(i, 1) - 1, list((older or {}).get(i, []))
            self.older[i] = kept[-keep:] if keep > 0 else []
            self.states[i] = new[i]
            self.derived.pop(i, None)
            self._views.pop(i, None)
        self._forget_parts()

    def set_pools(self, sizes: dict) -> None:
        """Set state points' pool sizes (e.g. those a restored run was
        written with); their pools keep their newest earlier trajectories."""
        for i, size in sizes.items():
            self.pools[i] = int(size)
            if i in self.older:
                self.older[i] = self.older[i][-(size - 1):] if size > 1 else []
            self.derived.pop(i, None)
            self._views.pop(i, None)
        self._forget_parts()

    def sample(self, i: int, newest=None) -> list:
        """What state point ``i`` reweights from: its pool of trajectories
        (:func:`chemtrain.learn.pool.pooled`), or its newest alone with a
        pool of 1; with ``newest``, the pool that adding it would give."""
        if newest is not None:
            *older, newest = self._slots(i, newest)
            return pooled(older, newest, self.pools.get(i, 1))
        if i not in self._views:
            *older, newest = self._slots(i)
            self._views[i] = pooled(older, newest, self.pools.get(i, 1))
        return self._views[i]

    def _slots(self, i: int, newest=None) -> list:
        """The trajectories of state point ``i``'s pool, oldest first (with
        ``newest``: of the pool that adding it would give)."""
        size = self.pools.get(i, 1)
        older = self.older.get(i, []) if newest is None else [*self.older.get(i, []),
                                                               self.states[i]]
        return [*(older[-(size - 1):] if size > 1 else []),
                self.states[i] if newest is None else newest]

    def derived_of(self, objective, sp, params, newest=None):
        """``objective.derive`` of what state point ``sp`` reweights from
        (with ``newest``: of the pool that adding it would give), computed
        once per trajectory: from each trajectory's own where the objective
        combines them (``derive_pool``), else on the whole pool."""
        i = sp.index
        if newest is None and i in self.derived:
            return self.derived[i]
        size = self.pools.get(i, 1)
        if size == 1 or objective.derive_pool is None:
            derived = objective.derive(sp, params, self.sample(i, newest))
        else:
            derived = objective.derive_pool(sp, [self._part(objective, sp, params, t)
                                                 for t in self._slots(i, newest)], size)
        if newest is None:
            self.derived[i] = derived
        return derived

    def _part(self, objective, sp, params, trajs):
        if id(trajs) not in self._parts:
            self._parts[id(trajs)] = trajs, objective.derive(sp, params, trajs)
        return self._parts[id(trajs)][1]

    def _forget_parts(self):
        live = {id(t) for i in self.states for t in [*self.older.get(i, []), self.states[i]]}
        self._parts = {k: v for k, v in self._parts.items() if k in live}

    def run(self, sp, params, trajs, keys) -> list:
        """One trajectory per chain from the ends of ``trajs``."""
        return [self.restart.run(sp.run_fn, sp.neighbor_fn, params, t, k,
                                 statepoint=sp.name if sp.reference.shape[0] == 1
                                 else f"{sp.name}, chain {c}", **sp.state_kwargs)
                for c, (t, k) in enumerate(zip(trajs, keys))]

    def initial(self, sp, params, base_key, num_runs: int, check, bar) -> list:
        """The first trajectories of ``sp`` from its reference state:
        ``num_runs`` in a row (all but the last equilibrate); ``check(sp,
        trajs)`` sees the initial states before any MD."""
        trajs = [sp.init_fn(params, statepoint_key(base_key, sp.index, 0, c), R0,
                            **sp.state_kwargs) for c, R0 in enumerate(sp.reference)]
        check(sp, trajs)
        for r in range(num_runs):
            keys = [statepoint_key(base_key, sp.index, r + 1, c) for c in range(len(trajs))]
            trajs = self.run(sp, params, trajs, keys)
            bar.update()
        return trajs

    def exchange(self, statepoints, params, new: dict) -> dict:
        """Every process's newly sampled trajectories ``new``, on every
        process (structures from the trajectories each process holds, or
        from the state point's own functions)."""
        if self.strategy.process_count == 1:
            return new
        parts = self.strategy.host_allgather_object(difftre_io.pack(new))
        theirs = {i: chains for part in parts for i, chains in part.items() if i not in new}
        out = difftre_io.unpack(statepoints, params, theirs, self.states)
        out.update(new)
        return out

    def to_host(self, statepoints) -> tuple[dict, dict]:
        """(trees, infos) for a file: ``{"trajstates": ...}`` and, where
        pools hold earlier trajectories, ``{"trajpool": ...}``."""
        data, info = difftre_io.trajstates_to_host(self.states, statepoints)
        trees, infos = {"trajstates": data}, {"trajstates": info}
        pool, pool_info = difftre_io.pool_to_host(self.older)
        if pool:
            trees["trajpool"], infos["trajpool"] = pool, pool_info
        return trees, infos

    def read(self, statepoints, params, path: str, trainer_name: str) -> tuple[dict, dict]:
        """The trajectories saved in ``path`` (a trajectory-state file or a
        checkpoint), read on the root and sent to every process; checked
        against ``statepoints`` leaf by leaf: (newest per state point, the
        pools' earlier ones). Collective."""
        meta, leaves, pool = on_root(self.strategy, lambda: difftre_io.read(path, trainer_name),
                                     share=False, only_root=True) or (None, None, None)
        meta = self.strategy.bcast_object(meta)
        if self.strategy.process_count > 1:
            leaves, pool = self.strategy.broadcast_from_root((leaves, pool))
        return (difftre_io.trajstates_from_host(statepoints, params, meta, leaves,
                                                range(len(statepoints)), path),
                difftre_io.pool_from_host(statepoints, params, meta, pool, path))


"""The trajectories of a reweighting trainer's state points
(:class:`TrajectoryStore`): sampling with neighbor-list restarts
(:class:`~chemtrain.simulate.RestartPolicy`), what an objective derives
once per trajectory, the exchange of newly sampled trajectories between
processes and their plain-data files (:mod:`.difftre_io`)."""
from __future__ import annotations

from ..learn.difftre_batches import statepoint_key
from ..parallel import on_root
from . import difftre_io


class TrajectoryStore:
    """State point -> its trajectory states (one
    :class:`~chemtrain.simulate.TrajState` per chain), on every process.

    Args:
      strategy: the trainer's parallel strategy (its communicator).
      restart: the :class:`~chemtrain.simulate.RestartPolicy` of every run.

    Attributes:
      states: state point -> list of trajectory states.
      derived: state point -> the objective's ``derive`` of its current
        trajectories (dropped whenever they are replaced).
    """

    def __init__(self, strategy, restart):
        self.strategy, self.restart = strategy, restart
        self.states: dict[int, list] = {}
        self.derived: dict[int, object] = {}

    def put(self, new: dict) -> None:
        """Replace the trajectories of the state points in ``new``."""
        self.states.update(new)
        for i in new:
            self.derived.pop(i, None)

    def derived_of(self, objective, sp, params):
        """``objective.derive`` of state point ``sp``'s trajectories,
        computed once per trajectory."""
        if sp.index not in self.derived:
            self.derived[sp.index] = objective.derive(sp, params, self.states[sp.index])
        return self.derived[sp.index]

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
        """(numpy pytree, JSON-able info) for a file."""
        return difftre_io.trajstates_to_host(self.states, statepoints)

    def read(self, statepoints, params, path: str, trainer_name: str) -> dict:
        """The trajectories saved in ``path`` (a trajectory-state file or a
        checkpoint), read on the root and sent to every process; checked
        against ``statepoints`` leaf by leaf. Collective."""
        meta, leaves = on_root(self.strategy, lambda: difftre_io.read(path, trainer_name),
                               share=False, only_root=True) or (None, None)
        meta = self.strategy.bcast_object(meta)
        if self.strategy.process_count > 1:
            leaves = self.strategy.broadcast_from_root(leaves)
        return difftre_io.trajstates_from_host(statepoints, params, meta, leaves,
                                               range(len(statepoints)), path)


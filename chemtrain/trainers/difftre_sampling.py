"""Sampling of the DiffTRe loop: the trajectories of a state point (with
neighbor-list restarts), the first trajectories of a run, and the check of
every state point on its first configuration. Mixed into
:class:`~.difftre_core._DifftreCore`, whose attributes (``statepoints``,
``strategy``, ``reporter``, ``trajstates``, ...) it uses."""
from __future__ import annotations

import jax

from ..learn import difftre as dt
from ..learn.difftre_checks import check_statepoint
from ..models.template import check_reach
from ..simulate.trajectory import run_with_restart
from .services import collective


class DifftreSampling:
    """Trajectories of the state points."""

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
                self._preflight(sp, trajs)
                for r in range(num_runs):
                    keys = [dt.statepoint_key(base, i, r + 1, c) for c in range(len(trajs))]
                    trajs = self._run(sp, self.params, trajs, keys)
                    bar.update()
                new[i] = trajs
            bar.close()
            return new

        self.trajstates.update(self._exchange(
            self._agree(compute, "sampling initial trajectories")))
        reuses = self._reuses()
        for i in (range(self.n_statepoints) if statepoints is None else statepoints):
            reuses[i] = 0   # a fresh trajectory
        self.state = self.state.replace(init_runs=num_runs, reuses=reuses)

    def _preflight(self, sp, trajs):
        """Check state point ``sp`` on its first configuration, once
        (:func:`chemtrain.learn.difftre_checks.check_statepoint`)."""
        if sp.index not in sp.fns.checked:
            check_reference_span(sp, trajs[0].nbrs)
            check_reach(sp.fns.energy_fn_template, trajs[0].nbrs, f"State point {sp.name}",
                        periodic_box="box" in sp.state_kwargs)
            check_statepoint(sp, self.params, trajs[0])
            sp.fns.checked.add(sp.index)


def check_reference_span(sp, nbrs) -> None:
    """Refuse a reference state that spans more than 3 box lengths of the
    periodic box its neighbor list (or ``state_kwargs['box']``) was built
    with: positions in Å for a model in nm give 10 (issue 37)."""
    import numpy as np
    from ..neighbors import list_box
    box = sp.state_kwargs.get("box")
    box = list_box(nbrs) if box is None else np.asarray(box, np.float64)
    if box is None:
        return
    ref = np.asarray(sp.reference, np.float64).reshape(-1, np.shape(sp.reference)[-1])
    dim = ref.shape[-1]
    sides = (np.diag(box) if np.ndim(box) == 2 else np.broadcast_to(box, (dim,)))
    span = np.ptp(ref, axis=0)
    if np.any(span > 3.0 * sides):
        raise ValueError(
            f"State point {sp.name}: the reference state spans {np.round(span, 4).tolist()} "
            f"but the periodic box is {np.round(sides, 4).tolist()} wide "
            f"({float(np.max(span / sides)):.3g} box lengths): positions in other units than "
            f"the model's (Å for nm: divide by 10)? Give reference states in the units of the "
            f"box and the model.")

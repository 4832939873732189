"""Checks of a DiffTRe state point on its first configuration, before any
trajectory runs: inputs that would otherwise train on something else than
the user meant, without a word.

- ``state_kwargs`` keys that nothing reads (a misspelled ``'Pressure'`` or
  ``'masses'``): found by tracing the energy function and every quantity
  and seeing which inputs their programs use;
- a periodic box narrower than twice the neighbor list's cutoff when the
  energy reads the list (a minimum-image list counts one image per pair,
  as ``ForceMatching`` refuses too);
- a potential energy of the reference state that is not finite or absurdly
  large (e.g. jax-md's ``smap.pair_neighbor_list`` given a displacement
  where it wants a metric);
- what a quantity checks itself (``fn.preflight``: the pressure refuses an
  energy function that ignores jax-md's ``perturbation``).
"""
from __future__ import annotations

import difflib

import jax
import numpy as np

from ..ensemble import energy_kwargs, is_npt
from ..neighbors import check_minimum_image, list_box, list_cutoff

#: |U| per particle (kJ/mol) above which a reference energy is called absurd
ABSURD_ENERGY_PER_PARTICLE = 1e7


def _read_inputs(fn, args) -> set | None:
    """Indices of the flattened ``args`` that the program of ``fn(args)``
    reads (None when it cannot be traced with them)."""
    leaves = jax.tree.leaves(args)
    try:
        closed = jax.make_jaxpr(fn)(args)
    except TypeError:
        return None
    jaxpr = closed.jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    assert len(jaxpr.invars) == len(leaves)
    return {k for k, v in enumerate(jaxpr.invars) if id(v) in used}


def _keys_read(fn, kwargs: dict) -> set:
    """The keys of ``kwargs`` (one array each) that ``fn(kwargs)`` reads."""
    keys = sorted(kwargs)
    read = _read_inputs(fn, {k: kwargs[k] for k in keys})
    return set() if read is None else {keys[i] for i in read}


def check_state_kwargs(index, state_kwargs, energy_fn, quantities, state, nbrs) -> None:
    """Refuse ``state_kwargs`` keys that neither the simulator (``kT``,
    ``mass``; ``pressure`` and ``box`` in NPT), the energy function nor a
    quantity reads, naming the closest known key."""
    readers = {"kT", "mass"} | ({"pressure", "box"} if is_npt(state) else set())
    kw = {k: v for k, v in state_kwargs.items() if k not in readers}
    if not kw:
        return
    read = _keys_read(lambda k: energy_fn(state.position, neighbor=nbrs,
                                          **energy_kwargs(state, k)), kw)
    for fn in quantities.values():
        if read == set(kw):
            break
        read |= _keys_read(lambda k, fn=fn: fn(state, neighbor=nbrs, energy_fn=energy_fn, **k), kw)
    unused = sorted(set(kw) - read)
    if unused:
        known = sorted(readers | {"kT", "mass", "pressure", "box"} | read)
        hints = "".join(f" {k!r}: did you mean {m[0]!r}?" for k in unused
                        if (m := difflib.get_close_matches(k, known, 1, 0.6)))
        raise ValueError(
            f"State point {index}: state_kwargs {unused} are read by nothing: not by the "
            f"simulator (kT, mass, and pressure and box in NPT), not by the energy function and "
            f"not by any quantity.{hints} Remove or rename them.")


def check_geometry(index, energy_fn, state, nbrs, energy_kw) -> None:
    """Refuse a box narrower than twice the list's cutoff when the energy
    reads the neighbor list: jax-md's list holds one image of each pair."""
    cutoff, box = list_cutoff(nbrs), list_box(nbrs)
    if cutoff is None or box is None or is_npt(state):
        return
    reads_list = _read_inputs(lambda idx: energy_fn(state.position,
                                                    neighbor=nbrs.set(idx=idx), **energy_kw),
                              nbrs.idx)
    if reads_list:
        dim = state.position.shape[-1]
        box3 = np.diag(np.broadcast_to(box, (dim,))) if np.ndim(box) < 2 else box
        if dim == 3:
            check_minimum_image(box3, cutoff, name=f"State point {index}: the box",
                                fix="Use a box at least twice the cutoff wide (more "
                                    "particles), or a shorter neighbor-list cutoff.")


def check_energy_value(index, energy, forces, n_particles: int) -> None:
    """Refuse a reference energy that is not finite or absurdly large, and
    forces (the simulator's initial ones, if it keeps them) that are not
    finite."""
    U = float(energy)
    if not (np.isfinite(U) and abs(U) <= ABSURD_ENERGY_PER_PARTICLE * n_particles):
        what = (f"the potential energy of the reference state is {U:.4g} kJ/mol "
                f"({U / n_particles:.4g} per particle)")
    elif forces is not None and not np.all(np.isfinite(np.asarray(forces))):
        bad = np.nonzero(~np.all(np.isfinite(np.asarray(forces)), axis=-1))[0]
        what = (f"the forces of the reference state are not finite (particles "
                f"{bad[:8].tolist()}{' ...' if bad.size > 8 else ''}; energy {U:.6g} kJ/mol)")
    else:
        return
    raise ValueError(
        f"State point {index}: {what}, which no simulation can start from. Common causes: "
        f"particles that overlap in the reference positions, parameters in the wrong units, or "
        f"jax-md's smap.pair_neighbor_list(fn, displacement, ...) given a displacement function "
        f"where it takes a metric (pass space.canonicalize_displacement_or_metric(displacement)).")


def check_statepoint(sp, params, traj, quantities) -> None:
    """All checks of state point ``sp`` at its initial trajectory state
    ``traj`` (:class:`chemtrain.simulate.TrajState`, before any MD), with
    its per-snapshot ``quantities`` (name -> function; may be empty)."""
    state, nbrs = traj.sim_state, traj.nbrs
    energy_fn = sp.fns.energy_fn_template(params)
    ekw = energy_kwargs(state, sp.state_kwargs)
    check_energy_value(sp.name, sp.fns.energy(params, state.position, nbrs, ekw),
                       getattr(state, "force", None), state.position.shape[0])
    for name, fn in quantities.items():
        preflight = getattr(fn, "preflight", None)
        if preflight is not None:
            preflight(state, neighbor=nbrs, energy_fn=energy_fn, where=f"State point {sp.name}, "
                      f"quantity {name!r}", **sp.state_kwargs)
    check_geometry(sp.name, energy_fn, state, nbrs, ekw)
    check_state_kwargs(sp.name, sp.state_kwargs, energy_fn, quantities, state, nbrs)


def check_reference_span(sp, nbrs) -> None:
    """Refuse a reference state that spans more than 3 box lengths of the
    periodic box its neighbor list (or ``state_kwargs['box']``) was built
    with: positions in Å for a model in nm give 10 (issue 37)."""
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

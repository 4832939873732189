"""Helpers shared by the quantity modules: the box of a snapshot and the
masses of a state (the keyword arguments a state gives and volumes are in
:mod:`chemtrain.ensemble`)."""
from __future__ import annotations

import jax.numpy as jnp

from ..ensemble import is_npt


def snapshot_box(state, box, kwargs):
    """The box of one snapshot: an NPT state's own box, else the box given to
    the quantity's factory, else ``box`` among the call's keyword arguments."""
    if is_npt(state):
        from jax_md import simulate
        return simulate.npt_box(state)
    if box is not None:
        return jnp.asarray(box)
    if kwargs.get("box") is not None:
        return jnp.asarray(kwargs["box"])
    raise ValueError("This quantity needs the simulation box: pass box=... to its factory (a "
                     "scalar side, a vector of sides or a box matrix, in nm), or in "
                     "state_kwargs.")


def masses(state):
    """Per-particle masses (N,) of a jax-md state (scalar or (N,)/(N, 1) mass)."""
    n = state.position.shape[0]
    m = jnp.asarray(state.mass)
    return jnp.broadcast_to(m.reshape(-1) if m.ndim else m, (n,))

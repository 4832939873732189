"""Helpers shared by the quantity modules: the box, volume and keyword
arguments a snapshot gives to displacements and energy functions."""
from __future__ import annotations

import jax.numpy as jnp

from ..simulate.trajectory import ENSEMBLE_KEYS


def is_npt(state) -> bool:
    return hasattr(state, "box_position")


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


def volume(box, dim: int):
    box = jnp.asarray(box)
    if box.ndim == 0:
        return box ** dim
    if box.ndim == 1:
        return jnp.prod(box)
    return jnp.abs(jnp.linalg.det(box))


def displacement_kwargs(state) -> dict:
    """Keyword arguments for the displacement: the box of an NPT state
    (fractional coordinates), nothing for fixed boxes."""
    if is_npt(state):
        from jax_md import simulate
        return {"box": simulate.npt_box(state)}
    return {}


def energy_kwargs(state, kwargs) -> dict:
    """Keyword arguments for the energy function: the NPT box plus the
    non-reserved state_kwargs (the same the trajectory generator uses)."""
    out = {k: v for k, v in kwargs.items() if k not in ENSEMBLE_KEYS}
    out.update(displacement_kwargs(state))
    return out


def masses(state):
    """Per-particle masses (N,) of a jax-md state (scalar or (N,)/(N, 1) mass)."""
    n = state.position.shape[0]
    m = jnp.asarray(state.mass)
    return jnp.broadcast_to(m.reshape(-1) if m.ndim else m, (n,))

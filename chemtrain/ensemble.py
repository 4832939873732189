"""What a simulation state tells the functions evaluated on it, in one place:
whether it is an NPT state (it carries its box), the keyword arguments its
box gives to displacements, neighbor-list updates and energies, the keyword
arguments of the energy function at a state point, and cell volumes.

Used by the trajectory generator (:mod:`chemtrain.simulate`), the quantities
(:mod:`chemtrain.quantity`), the DiffTRe loss (:mod:`chemtrain.learn`) and
the force-matching stress.
"""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp

# state_kwargs that set the ensemble (thermostat, barostat, masses, box);
# all others are passed on to the energy function
ENSEMBLE_KEYS = ("kT", "pressure", "mass", "box")


def is_npt(state) -> bool:
    """Whether ``state`` is a jax-md NPT state (it carries its box)."""
    return hasattr(state, "box_position")


def box_kwargs(state) -> dict:
    """The box keyword arguments a simulation state needs.

    Args:
      state: a jax-md simulator state (NVT or NPT).

    Returns:
      ``{'box': box}`` for an NPT state (its current box, for the
      displacement, the neighbor-list update and the energy; positions are
      fractional coordinates), ``{}`` for a state in a fixed box.
    """
    if is_npt(state):
        from jax_md import simulate
        return {"box": simulate.npt_box(state)}
    return {}


def energy_kwargs(state, state_kwargs: Mapping) -> dict:
    """Keyword arguments of the energy function at ``state``: the
    non-ensemble ``state_kwargs`` and, for NPT states, the state's box."""
    out = {k: v for k, v in state_kwargs.items() if k not in ENSEMBLE_KEYS}
    out.update(box_kwargs(state))
    return out


def volume(box, dim: int = 3):
    """Volume of a box: side**dim for a scalar side, the product of a vector
    of sides, |det| of a box matrix (0 for an all-zero matrix: no cell).
    Traceable."""
    box = jnp.asarray(box)
    if box.ndim == 0:
        return box ** dim
    if box.ndim == 1:
        return jnp.prod(box)
    return jnp.abs(jnp.linalg.det(box))

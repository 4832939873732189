"""Thermodynamic per-snapshot quantities: kinetic energy, temperature,
potential energy, virial pressure and density.

Every factory returns ``fn(state, neighbor=None, energy_fn=None,
**state_kwargs)`` evaluated on one jax-md simulator state (a snapshot);
callers vmap it over a trajectory. Quantities that depend on the potential
take ``energy_fn`` at call time, so DiffTRe can pass the energy function of
the current parameters and differentiate through it. Units: kJ/mol, nm, amu;
pressures in kJ/mol/nm^3 (1 kJ/mol/nm^3 = 16.6054 bar), densities in
amu/nm^3 (x AMU_PER_NM3_TO_KG_PER_M3 for kg/m^3).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..ensemble import energy_kwargs, volume
from .common import masses, snapshot_box

AMU_PER_NM3_TO_KG_PER_M3 = 1.66053906660
KJ_PER_MOL_NM3_TO_BAR = 16.6053906660


def _kinetic(state):
    p = state.momentum
    return 0.5 * jnp.sum(p * p / masses(state)[:, None])


def _need_energy_fn(energy_fn, name):
    if energy_fn is None:
        raise ValueError(f"The {name} quantity needs the energy function: call it as "
                         f"fn(state, neighbor=nbrs, energy_fn=energy_fn).")


def kinetic_energy():
    """Kinetic energy ``sum p^2 / 2m`` (kJ/mol) of a snapshot.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving the
      kinetic energy (scalar, kJ/mol) from the state's momenta (amu nm/ps) and
      masses (amu, one for all or one per particle); ``neighbor`` and
      ``energy_fn`` are not used.
    """
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        return _kinetic(state)
    return fn


def temperature():
    """Instantaneous kinetic temperature of a snapshot, as ``kT`` in kJ/mol.

    ``kT = 2 KE / (N d)`` for N particles in d dimensions.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving
      ``kT`` (scalar, kJ/mol); divide by
      ``chemtrain.units.BOLTZMANN_KJ_PER_MOL_K`` for kelvin.
    """
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        return 2.0 * _kinetic(state) / state.position.size
    return fn


def potential_energy():
    """Potential energy ``energy_fn(R, neighbor)`` (kJ/mol) of a snapshot.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving the
      potential energy (scalar, kJ/mol). ``energy_fn`` is given at call time
      (so DiffTRe can pass the energy function of the current parameters); it
      receives the non-ensemble ``state_kwargs`` and, for NPT states, the
      state's box. ``fn`` raises ValueError without ``energy_fn``.
    """
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        _need_energy_fn(energy_fn, "potential_energy")
        return energy_fn(state.position, neighbor=neighbor, **energy_kwargs(state, kwargs))
    return fn


def pressure(box=None, include_kinetic: bool = True):
    """Virial pressure ``(2 KE - dU/d eps) / (d V)`` (kJ/mol/nm^3) of a snapshot.

    ``dU/d eps`` is the derivative of the potential energy when every
    displacement is scaled by ``1 + eps``, taken through jax-md's
    ``perturbation`` keyword, which the energy function must forward to its
    displacement function (chemtrain's pair templates and jax-md's ``smap``
    energies do). Multiply by ``KJ_PER_MOL_NM3_TO_BAR`` for bar.

    Args:
      box: the fixed box (NVT) in nm, a side length, side lengths or a box
        matrix; NPT snapshots use their own. None: the ``box=`` of the call's
        ``state_kwargs``.
      include_kinetic: include the kinetic term ``2 KE``; False gives the
        configurational part only.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving the
      pressure (scalar, kJ/mol/nm^3); it raises ValueError without
      ``energy_fn`` or without a box. ``fn.preflight(state, neighbor=None,
      energy_fn=None, where='pressure', **state_kwargs)`` raises ValueError
      (the message starting with ``where``) for an energy function that does
      not accept ``perturbation=`` or ignores it (a strain derivative of
      exactly 0 while the forces are not).
    """
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        _need_energy_fn(energy_fn, "pressure")
        R = state.position
        dim = R.shape[-1]
        vol = volume(snapshot_box(state, box, kwargs), dim)
        ekw = energy_kwargs(state, kwargs)

        def U(eps):
            return energy_fn(R, neighbor=neighbor, perturbation=1.0 + eps, **ekw)

        dU = jax.grad(U)(jnp.zeros((), R.dtype))
        kinetic = 2.0 * _kinetic(state) if include_kinetic else 0.0
        return (kinetic - dU) / (dim * vol)

    def preflight(state, neighbor=None, energy_fn=None, where="pressure", **kwargs):
        """Refuse an energy function that ignores ``perturbation``: its strain
        derivative is exactly zero while its forces are not, and the pressure
        would be the kinetic part alone."""
        R, ekw = state.position, energy_kwargs(state, kwargs)
        try:
            dU, F = jax.jit(lambda r: (
                jax.grad(lambda e: energy_fn(r, neighbor=neighbor, perturbation=1.0 + e, **ekw))(
                    jnp.zeros((), r.dtype)),
                jax.grad(lambda x: energy_fn(x, neighbor=neighbor, **ekw))(r)))(R)
        except TypeError as e:
            raise ValueError(f"{where}: the pressure calls the energy function with "
                             f"perturbation=..., which it does not accept ({e}). Give it "
                             f"**kwargs and pass perturbation on to the displacement function, "
                             f"as chemtrain's pair templates do.") from None
        if float(dU) == 0.0 and bool(jnp.any(F != 0)):
            raise ValueError(
                f"{where}: the energy function ignores jax-md's perturbation= (its strain "
                f"derivative is exactly 0 while the forces are not), so the pressure would be "
                f"the kinetic part alone. Pass perturbation on to the displacement function "
                f"(displacement_fn(Ra, Rb, perturbation=...)), as chemtrain's pair templates "
                f"and jax-md's smap energies do.")
    fn.preflight = preflight
    return fn


def density(box=None):
    """Mass density ``sum m / V`` (amu/nm^3) of a snapshot.

    Multiply by ``AMU_PER_NM3_TO_KG_PER_M3`` for kg/m^3.

    Args:
      box: as in :func:`pressure`, the fixed box (NVT) in nm; NPT snapshots use
        their own; None: the ``box=`` of the call's ``state_kwargs``.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving the
      density (scalar, amu/nm^3); it raises ValueError when no box is known.
    """
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        vol = volume(snapshot_box(state, box, kwargs), state.position.shape[-1])
        return jnp.sum(masses(state)) / vol
    return fn

"""Dynamic quantities: time-correlation functions of short NVE segments and
the transport coefficients they integrate to.

A segment (:func:`chemtrain.learn.dynamics.make_segment`) records, at each
of its steps, the velocity autocorrelation of its particles with their
start velocities, their mean squared displacement since the start and,
where asked, the stress tensor's off-diagonal components; the functions
here turn such series into self-diffusion coefficients, by Green-Kubo (the
integral of the velocity autocorrelation) and by Einstein (the slope of
the mean squared displacement), and into the Green-Kubo shear viscosity. They are plain JAX functions
of arrays, differentiable and usable inside ``jit``.

Units are chemtrain's: nm, ps, amu, kJ/mol. Velocities are in nm/ps, the
velocity autocorrelation in nm^2/ps^2, diffusion coefficients in nm^2/ps
(multiply by :data:`NM2_PER_PS_TO_M2_PER_S` for m^2/s: 2.36e-9 m^2/s is
2.36e-3 nm^2/ps), viscosities in kJ/mol/nm^3 ps (multiply by
:data:`KJ_PER_MOL_NM3_PS_TO_MPA_S` for mPa s).
"""
from __future__ import annotations

import jax.numpy as jnp

#: 1 nm^2/ps in m^2/s (multiply)
NM2_PER_PS_TO_M2_PER_S = 1e-6
#: 1 kJ/mol/nm^3 ps in mPa s (multiply): 1 kJ/mol/nm^3 is 1.66054e6 Pa
KJ_PER_MOL_NM3_PS_TO_MPA_S = 1.66053906660e-3


def velocity_autocorrelation(v0, v, mask=None):
    """The velocity autocorrelation ``<v_i(0)·v_i(t)>`` of the particles
    (nm^2/ps^2).

    Args:
      v0: the start velocities (N, dim), nm/ps.
      v: the velocities at time t (N, dim).
      mask: optional (N,) booleans: average over the True ones only.

    Returns:
      A scalar: the mean dot product of each particle's two velocities.
    """
    dots = jnp.sum(v0 * v, axis=-1)
    if mask is None:
        return jnp.mean(dots)
    return jnp.sum(jnp.where(mask, dots, 0.0)) / jnp.sum(mask)


def mean_squared_displacement(displacement, mask=None):
    """``<|r_i(t) - r_i(0)|^2>`` over the particles (nm^2).

    Args:
      displacement: each particle's unwrapped displacement since the start
        (N, dim), nm.
      mask: optional (N,) booleans: average over the True ones only.

    Returns:
      A scalar, nm^2.
    """
    sq = jnp.sum(displacement ** 2, axis=-1)
    if mask is None:
        return jnp.mean(sq)
    return jnp.sum(jnp.where(mask, sq, 0.0)) / jnp.sum(mask)


def integrate(series, dt):
    """The trapezoidal integral of a sampled series.

    Args:
      series: samples ``dt`` apart along the last axis.
      dt: the spacing of the samples.

    Returns:
      The integral from the first to the last sample (one per leading index).
    """
    series = jnp.asarray(series)
    return dt * (jnp.sum(series, axis=-1) - 0.5 * (series[..., 0] + series[..., -1]))


def green_kubo_diffusion(vacf, dt, dim: int = 3):
    """Green-Kubo self-diffusion coefficient ``D = (1/dim) integral
    <v(0).v(t)> dt``.

    Args:
      vacf: the velocity autocorrelation (nm^2/ps^2) sampled every ``dt``
        from t = 0; it must have decayed by its end (about 2 ps for liquid
        argon).
      dt: the spacing of the samples (ps).
      dim: the number of dimensions.

    Returns:
      D in nm^2/ps (x :data:`NM2_PER_PS_TO_M2_PER_S` for m^2/s).
    """
    return integrate(vacf, dt) / dim


def green_kubo_viscosity(sacf, dt, volume, kT):
    """Green-Kubo shear viscosity ``eta = V / kT integral <P_ab(0) P_ab(t)>
    dt``.

    Args:
      sacf: the autocorrelation of the stress tensor's off-diagonal
        components (kJ/mol/nm^3)^2, sampled every ``dt`` from t = 0.
      dt: the spacing of the samples (ps).
      volume: the box volume (nm^3).
      kT: the thermal energy (kJ/mol).

    Returns:
      eta in kJ/mol/nm^3 ps (x :data:`KJ_PER_MOL_NM3_PS_TO_MPA_S` for mPa s).
    """
    return volume / kT * integrate(sacf, dt)


def einstein_diffusion(msd, dt, fit_from: float = 0.5, dim: int = 3):
    """Einstein self-diffusion coefficient ``D = slope / (2 dim)`` of the
    mean squared displacement.

    Args:
      msd: the mean squared displacement (nm^2) sampled every ``dt`` from
        t = 0.
      dt: the spacing of the samples (ps).
      fit_from: the least-squares line is fitted from this fraction of the
        series to its end (the diffusive regime, past the ballistic start).
      dim: the number of dimensions.

    Returns:
      D in nm^2/ps.
    """
    msd = jnp.asarray(msd)
    n = msd.shape[-1]
    start = min(int(fit_from * (n - 1)), n - 2)
    t = dt * jnp.arange(start, n)
    y = msd[..., start:]
    tc = t - jnp.mean(t)
    slope = jnp.sum(tc * (y - jnp.mean(y, axis=-1, keepdims=True)), axis=-1) / jnp.sum(tc ** 2)
    return slope / (2 * dim)

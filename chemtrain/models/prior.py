"""Prior potentials and sums of energy templates.

A machine-learned potential trained on ensemble averages (DiffTRe) or
relative entropy rarely sees configurations with overlapping particles, so
it is usually given a physical *prior* that keeps particles apart: the sum
``prior + ML`` is trained, often with the prior's parameters fixed.

- :func:`repulsive_template`: ``epsilon (sigma / r)^12``, smoothly switched
  off between ``r_onset`` and ``r_cutoff`` (upstream chemtrain's repulsive
  prior). The pair, bond and Lennard-Jones templates of
  :mod:`chemtrain.models.pair` serve as priors too.
- :func:`sum_templates`: ``{"prior": template, "mace": template}`` -> one
  template on parameters ``{"prior": ..., "mace": ...}`` whose energy is the
  sum.
- :func:`chemtrain.models.freeze` (in :mod:`.frozen`): an optimizer that
  leaves named entries of the parameters, e.g. the prior, unchanged.
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from .pair import displacement_kwargs, pair_energy
from .template import EnergyTemplate, as_template, periodic


def repulsive_template(displacement_fn: Callable, r_cutoff: float,
                       r_onset: float | None = None) -> Callable:
    """Repulsive prior template ``epsilon (sigma / r)^12``, smoothly switched off.

    The repulsion is multiplied by jax-md's smooth switch from 1 at
    ``r_onset`` to 0 at ``r_cutoff`` and summed over the pairs of a neighbor
    list or graph (see :func:`~chemtrain.models.pair_energy`); this is upstream
    chemtrain's repulsive prior. The template's parameters are
    ``{'sigma': nm, 'epsilon': kJ/mol}``. Its energy function
    ``energy_fn(positions, neighbor, **kwargs)`` takes positions (N, 3) in nm,
    forwards ``box`` and ``perturbation`` from ``kwargs`` to the displacement
    function, ignores other keyword arguments and returns the total energy (a
    scalar, kJ/mol).

    Args:
      displacement_fn: jax-md displacement function; may be None for
        precomputed graphs.
      r_cutoff: distance in nm beyond which the energy is zero.
      r_onset: distance in nm where the switch starts; default
        ``0.9 * r_cutoff``.

    Returns:
      An :class:`~chemtrain.models.EnergyTemplate` with ``cutoff=r_cutoff``
      and ``periodic`` inferred from ``displacement_fn``. Calling it raises
      ``ValueError`` if the parameters are not a dict holding ``'sigma'`` and
      ``'epsilon'``.

    Raises:
      ValueError: unless ``0 < r_onset < r_cutoff``.
    """
    from jax_md import energy as jmd_energy
    r_onset = 0.9 * r_cutoff if r_onset is None else r_onset
    if not 0 < r_onset < r_cutoff:
        raise ValueError(f"repulsive_template needs 0 < r_onset < r_cutoff, got r_onset="
                         f"{r_onset} and r_cutoff={r_cutoff}.")
    switched = jmd_energy.multiplicative_isotropic_cutoff(
        lambda r, sigma, epsilon: epsilon * (sigma / r) ** 12, r_onset, r_cutoff)

    def template(params):
        missing = (["sigma", "epsilon"] if not isinstance(params, Mapping) else
                   [k for k in ("sigma", "epsilon") if k not in params])
        if missing:
            raise ValueError(f"repulsive_template's parameters are a dict {{'sigma': nm, "
                             f"'epsilon': kJ/mol}}; missing {missing} in {params!r}.")

        def energy_fn(positions, neighbor, **kwargs):
            return pair_energy(lambda r: switched(r, params["sigma"], params["epsilon"]),
                               displacement_fn, positions, neighbor, **displacement_kwargs(kwargs))
        return energy_fn
    return EnergyTemplate(template, cutoff=float(r_cutoff), periodic=periodic(displacement_fn))


def sum_templates(templates: Mapping[str, Callable]) -> EnergyTemplate:
    """Combine energy templates into one whose energy is the sum of the parts.

    Every part receives the positions, the neighbor list and all keyword
    arguments. The energy function ``energy_fn(positions, neighbor=None,
    **kwargs)`` takes positions (N, 3) in nm and returns the sum of the
    parts' energies (a scalar, kJ/mol).

    Args:
      templates: dict ``{name: template}``, e.g.
        ``{"prior": ..., "mace": ...}``; each template is a callable or an
        :class:`~chemtrain.models.EnergyTemplate`. The names key the parameters.

    Returns:
      An :class:`~chemtrain.models.EnergyTemplate` on parameters
      ``{name: that part's parameters}``. It keeps shard_map's varying-axis check
      (``check_vma``) only if every part can, checks datasets with every part's
      ``validate_dataset``, reaches as far as the part of largest ``cutoff``,
      is ``periodic=False`` if any part is built on free space (None
      otherwise), and has ``batched`` energies if any part has them (the
      other parts are vmapped). Calling it raises ``ValueError`` if the parameters are not a
      dict with an entry for every part, and ``TypeError`` if a part's template
      does not return a callable; the energy function raises ``ValueError`` if
      a part returns an energy that is not a scalar (per-particle energies).

    Raises:
      ValueError: if ``templates`` is not a non-empty mapping, or a name is not
        a non-empty string.
      TypeError: (from :func:`~chemtrain.models.as_template`) if a part is not
        callable or carries attributes.
    """
    if not isinstance(templates, Mapping) or not templates:
        raise ValueError(f"sum_templates needs a non-empty dict {{name: template}}, got "
                         f"{templates!r}.")
    bad = [name for name in templates if not isinstance(name, str) or not name]
    if bad:
        raise ValueError(f"sum_templates: the names of the parts must be non-empty strings "
                         f"(they key the parameters), got {bad!r}; name them e.g. 'prior', "
                         f"'mace'.")
    parts = {name: as_template(t) for name, t in templates.items()}

    def fn(params):
        missing = sorted(set(parts) - set(params)) if isinstance(params, Mapping) else None
        if missing is None or missing:
            raise ValueError(f"The parameters of a sum of templates are a dict with one entry per "
                             f"part {sorted(parts)}; "
                             + (f"missing {missing}." if missing else
                                f"got {type(params).__name__}."))
        energies = {name: t(params[name]) for name, t in parts.items()}
        for name, e in energies.items():
            if not callable(e):
                pair = (" (jax-md's (neighbor_fn, energy_fn) pair? take its energy_fn)"
                        if isinstance(e, tuple) else "")
                raise TypeError(f"sum_templates: part {name!r}'s template returned "
                                f"{type(e).__name__}{pair}; a template maps parameters to one "
                                f"energy function energy_fn(positions, neighbor, **kwargs).")

        def energy_fn(positions, neighbor=None, **kwargs):
            total = 0.0
            for name, e in energies.items():
                value = e(positions, neighbor=neighbor, **kwargs)
                if jnp.ndim(value) != 0:
                    raise ValueError(
                        f"sum_templates: part {name!r} returns an energy of shape "
                        f"{jnp.shape(value)}, not one number: per-particle energies? Each part "
                        f"must return the total potential energy (e.g. jax-md's "
                        f"energy functions with per_particle=False, or jnp.sum of them).")
                total = total + value
            return total
        return energy_fn

    def batched(params):
        # each part's own batched energies where it has them, a vmap over
        # every argument (all carry the leading structure axis) otherwise
        fns = {name: (t.batched(params[name]) if t.batched is not None
                      else jax.vmap(lambda R, nb, kw, e=t(params[name]): e(R, neighbor=nb, **kw)))
               for name, t in parts.items()}

        def energies(positions, neighbor=None, **kwargs):
            return sum(f(positions, neighbor, **kwargs) if parts[name].batched is not None
                       else f(positions, neighbor, kwargs) for name, f in fns.items())
        return energies

    checks = [t.validate_dataset for t in parts.values() if t.validate_dataset is not None]

    def validate(data):
        for check in checks:
            check(data)
    cutoffs = [t.cutoff for t in parts.values() if t.cutoff is not None]
    return EnergyTemplate(fn, check_vma=all(t.check_vma for t in parts.values()),
                          validate_dataset=validate if checks else None,
                          cutoff=max(cutoffs) if cutoffs else None,
                          periodic=False if any(t.periodic is False for t in parts.values())
                          else None,
                          batched=batched if any(t.batched is not None for t in parts.values())
                          else None)

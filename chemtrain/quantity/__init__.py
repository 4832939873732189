"""Per-snapshot quantities for DiffTRe and analysis.

Each factory returns ``fn(state, neighbor=None, energy_fn=None,
**state_kwargs) -> array`` for ONE jax-md simulator state; vmap it over the
snapshots of a trajectory. Structure (``structure``, ``angles``): ``rdf``, ``adf``.
Thermodynamics (``thermo``): ``pressure``, ``density``, ``potential_energy``,
``kinetic_energy``, ``temperature``. Dynamics (``dynamics``): time-correlation
functions of NVE segments and the transport coefficients they give
(``velocity_autocorrelation``, ``green_kubo_diffusion``, ``green_kubo_viscosity``, ...), on series
rather than single snapshots. Units: nm, kJ/mol, amu, rad, ps.
"""
from .angles import ADFParams, adf, adf_discretization
from .structure import RDFParams, rdf, rdf_discretization
from .dynamics import (KJ_PER_MOL_NM3_PS_TO_MPA_S, NM2_PER_PS_TO_M2_PER_S, einstein_diffusion,
                       green_kubo_diffusion, green_kubo_viscosity, mean_squared_displacement,
                       velocity_autocorrelation)
from .thermo import (AMU_PER_NM3_TO_KG_PER_M3, KJ_PER_MOL_NM3_TO_BAR, density, kinetic_energy,
                     potential_energy, pressure, temperature)

__all__ = ["rdf", "adf", "rdf_discretization", "adf_discretization", "RDFParams", "ADFParams",
           "pressure", "density", "potential_energy", "kinetic_energy", "temperature",
           "velocity_autocorrelation", "mean_squared_displacement", "green_kubo_diffusion",
           "einstein_diffusion", "green_kubo_viscosity", "AMU_PER_NM3_TO_KG_PER_M3",
           "KJ_PER_MOL_NM3_TO_BAR", "NM2_PER_PS_TO_M2_PER_S", "KJ_PER_MOL_NM3_PS_TO_MPA_S"]

"""Energy models as ``params -> energy_fn`` templates."""
from .pair import (harmonic_bond_template, init_pair_mlp, lennard_jones_template, pair_energy,
                   pair_mlp_template)
from .frozen import block_names, freeze
from .prior import repulsive_template, sum_templates
from .template import EnergyTemplate, as_template

__all__ = ["EnergyTemplate", "as_template", "harmonic_bond_template", "lennard_jones_template",
           "pair_mlp_template", "init_pair_mlp", "pair_energy", "repulsive_template",
           "sum_templates", "freeze", "block_names"]

"""NequIP (SevenNet's ``E3GNN``, a NequIP-type equivariant network) in JAX.

- :class:`NequipConfig`, :func:`init_params`, :func:`node_energies`: the model
  (Angstrom and eV, as sevenn).
- :func:`energy_fn_template`: the chemtrain energy function (nm, kJ/mol).
- :func:`load_sevennet`: read a SevenNet checkpoint (``.pth``), e.g. the
  published SevenNet-0 by its name ``'sevennet-0'``.
- :func:`save`, :func:`load`: a model as one plain-data ``.npz`` file.
- :func:`save_sevennet`: write fine-tuned parameters back as a checkpoint
  that sevenn's own calculator loads.
"""
from chemtrain.models.nequip.model import (NequipConfig, SILU_CONSTANT, init_params,
                                           node_energies, param_shapes)
from chemtrain.models.nequip.energy import energy_fn_template, check_species
from chemtrain.models.nequip.sevennet import (load_sevennet, resolve, UnsupportedSevenNetError,
                                              PRETRAINED)
from chemtrain.models.nequip.export import save_sevennet
from chemtrain.models.nequip.io import save, load

__all__ = ["NequipConfig", "SILU_CONSTANT", "init_params", "node_energies", "param_shapes",
           "energy_fn_template", "check_species", "load_sevennet", "save_sevennet", "resolve",
           "UnsupportedSevenNetError", "PRETRAINED", "save", "load"]

"""MACE (mace-torch's ``ScaleShiftMACE``) in JAX on cuequivariance-jax.

- :class:`MaceConfig`, :func:`init_params`, :func:`node_energies`: the model
  (Angstrom and eV, as mace-torch).
- :func:`energy_fn_template`: the chemtrain energy function (nm, kJ/mol) on
  jax-md neighbor lists.
- :func:`load_mace_torch`: read a mace-torch ``.model`` file (``mace-torch``
  extra); :func:`save` / :func:`load`: the converted model as plain data;
  :func:`export_mace_torch`: write a mace-torch ``.model`` file back.
- :func:`add_head`, :func:`select_head`: models of several heads
  (:attr:`MaceConfig.heads`, mace-torch's multi-head layout);
  :func:`default_head` and :func:`finetuned_head`: which head a calculator
  evaluates and a fine-tuning starts from, by mace-torch's rules.
"""
from chemtrain.models.mace.model import MaceConfig, Layer, node_energies
from chemtrain.models.mace.params import init_params, param_shapes
from chemtrain.models.mace.energy import (energy_fn_template, species_to_elements, check_species,
                                          LENGTH_TO_ANGSTROM, ENERGY_TO_KJ_PER_MOL, CHECK_VMA)
from chemtrain.models.species import UnknownElementError
from chemtrain.models.mace.io import (save, load, load_mace_torch, config_from_json,
                                      UnsupportedModelError, UntrustedFileError)
from chemtrain.models.mace.export import export_mace_torch
from chemtrain.models.mace.heads import add_head, default_head, finetuned_head, select_head

__all__ = ["MaceConfig", "Layer", "init_params", "node_energies", "param_shapes",
           "energy_fn_template", "species_to_elements", "check_species", "UnknownElementError",
           "LENGTH_TO_ANGSTROM", "ENERGY_TO_KJ_PER_MOL", "CHECK_VMA",
           "save", "load", "load_mace_torch", "config_from_json", "UnsupportedModelError",
           "UntrustedFileError", "export_mace_torch", "add_head", "select_head",
           "default_head", "finetuned_head"]

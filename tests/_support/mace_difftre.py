"""DiffTRe on a small MACE (or NequIP) plus a repulsive prior (16 atoms of one species
in a 1 nm box, float64): shared by tests/learn/test_difftre_grad.py and its
mpirun script."""
import functools

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import simulate, space

from chemtrain import quantity
from chemtrain.finetune.model import random_config
from chemtrain.models import mace as cm
from chemtrain.models import repulsive_template, sum_templates
from chemtrain.neighbors import neighbor_list
from chemtrain.simulate import process_printouts
from chemtrain.trainers import DifftreParallel
from chemtrain.trainers.options import split_options

BOX, R_MAX = 1.0, 0.4   # nm


def spread_positions(n, min_distance, seed=0):
    """``n`` random positions in the periodic box, none closer than
    ``min_distance`` (rejection sampling)."""
    rng, out = np.random.default_rng(seed), []
    while len(out) < n:
        r = rng.random(3) * BOX
        d = np.array(out) - r if out else np.zeros((0, 3))
        d -= BOX * np.round(d / BOX)
        if not len(out) or np.min(np.linalg.norm(d, axis=1)) >= min_distance:
            out.append(r)
    return np.array(out)


def mace_model(dtype=jnp.float64, family="mace"):
    """(template, parameters): a 4-channel MACE (or, with ``family`` 'nequip',
    a 4-channel two-layer NequIP) plus a repulsive prior; the model's
    parameters under the key 'mace' either way."""
    displacement, _ = space.periodic(BOX)
    if family == "nequip":
        from chemtrain.models import nequip
        cfg = nequip.NequipConfig(atomic_numbers=(8,), cutoff=10 * R_MAX, cutoff_function="poly",
                                  cutoff_on=0.0, poly_p=6, n_basis=6,
                                  irreps=(((4, 0),), ((4, 0), (4, 1)), ((4, 0),)),
                                  filter_lmax=1, radial_hidden=(8,), denominators=(2.5, 2.5))
        model = nequip.init_params(jax.random.PRNGKey(0), cfg, dtype)
        model["scale"] = model["scale"] * 0.05
        template = nequip.energy_fn_template(cfg, displacement)
    else:
        cfg = random_config((8,), avg_num_neighbors=6.0, scale=0.05, num_channels=4, max_L=0,
                            max_ell=1, correlation=2, r_max=10 * R_MAX, num_interactions=1,
                            radial_MLP=(8,))
        model = cm.init_params(cfg, jax.random.PRNGKey(0), dtype)
        template = cm.energy_fn_template(cfg, displacement)
    template = sum_templates({"prior": repulsive_template(displacement, R_MAX, 0.35),
                              "mace": template})
    params = {"prior": {"sigma": jnp.asarray(0.3, dtype), "epsilon": jnp.asarray(1.0, dtype)},
              "mace": model}
    return template, params


def rdf():
    """The RDF quantity of the trainer's target (20 bins up to R_MAX)."""
    displacement, _ = space.periodic(BOX)
    return quantity.rdf(displacement, quantity.rdf_discretization(R_MAX, 20, 0.1), box=BOX)


def mace_trainer(folder, kTs=(2.5,), species=8, dtype=jnp.float64, family="mace", **options):
    """(DifftreParallel, initial parameters): one state point per ``kTs``,
    an RDF target (through the weights) and a potential-energy target (an
    energy-dependent quantity), every atom of atomic number ``species``
    (None: no species given). ``dtype`` of the parameters: float64 needs
    jax_enable_x64 on, float32 runs with it off."""
    displacement, shift = space.periodic(BOX)
    template, params = mace_model(dtype, family)
    n = len(kTs)
    trainer = DifftreParallel(
        0, params, options.pop("optimizer", optax.sgd(1e-3)), template,
        functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.002, kT=kTs[0], gamma=5.0),
        neighbor_list(displacement, BOX, R_MAX, dr_threshold=0.02, capacity_multiplier=2.0),
        process_printouts(0.002, 0.6, 0.2, 0.02),
        {"kT": np.asarray(kTs, float), "mass": np.full(n, 18.0),
         **({} if species is None else {"species": np.full((n, 16), species)})},
        {"rdf": rdf(),
         "energy": quantity.potential_energy()},
        {"rdf": {"target": np.ones((n, 20)), "gamma": 1.0},
         "energy": {"target": np.full(n, -5.0), "gamma": 0.01}},
        reference_states=np.broadcast_to(spread_positions(16, 0.28), (n, 16, 3)),
        checkpoint_path=folder, **split_options(dict(options, progress=False)))
    return trainer, params

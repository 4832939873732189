"""A model's range against the neighbor list it is given (issue 37, cases
11-13): a list shorter than the model's cutoff drops the pairs in between,
and a free-space model in a periodic box misses pairs across the edge. Both
used to train silently (a prior truncated to 14.24 of 14.59 kJ/mol; MACE
energies 115.56 and 112.35 against 117.80)."""
import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, simulate, space

from chemtrain.finetune.model import random_config
from chemtrain.models import lennard_jones_template, mace, repulsive_template, sum_templates
from chemtrain.models.template import check_reach
from chemtrain.simulate import process_printouts
from chemtrain.trainers import Difftre, ForceMatching, RunOptions

BOX = 3.0


def lattice(n=27, box=BOX):
    per = int(round(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jnp.asarray((grid + 0.5) * box / per)


def test_force_matching_refuses_a_prior_reaching_past_the_list():
    displacement, _ = space.periodic(BOX)
    model = sum_templates({"prior": repulsive_template(displacement, 1.2),
                           "lj": lennard_jones_template(displacement, 0.9)})
    R = lattice()
    short = partition.neighbor_list(displacement, BOX, 0.9,
                                    format=partition.NeighborListFormat.Sparse).allocate(R)
    params = {"prior": {"sigma": 0.3, "epsilon": 1.0}, "lj": {"sigma": 0.34, "epsilon": 0.99}}
    with pytest.raises(ValueError, match=r"ForceMatching: the energy model reaches 1.2 nm, but the "
                                         r"neighbor list holds pairs only up to 0.9 nm.*at least "
                                         r"1.2 nm"):
        ForceMatching(params, optax.adam(1e-3), model, short, batch=1, parallelism="single",
                      options=RunOptions(progress=False))
    enough = partition.neighbor_list(displacement, BOX, 1.2,
                                     format=partition.NeighborListFormat.Sparse).allocate(R)
    ForceMatching(params, optax.adam(1e-3), model, enough, batch=1, parallelism="single",
                  options=RunOptions(progress=False))


def test_mace_range_and_free_space_against_the_list():
    cfg = random_config([18], 10.0, 1.0, num_channels=4, r_max=4.0, radial_MLP=[8])
    displacement, _ = space.periodic(BOX)
    R = lattice()
    short = partition.neighbor_list(displacement, BOX, 0.3,
                                    format=partition.NeighborListFormat.Sparse).allocate(R)
    full = partition.neighbor_list(displacement, BOX, 0.4,
                                   format=partition.NeighborListFormat.Sparse).allocate(R)
    periodic_model = mace.energy_fn_template(cfg, displacement)
    assert periodic_model.cutoff == pytest.approx(0.4) and periodic_model.periodic is True
    with pytest.raises(ValueError, match=r"reaches 0.4 nm, but the neighbor list holds pairs only "
                                         r"up to 0.3 nm"):
        check_reach(periodic_model, short, "DiffTRe")
    check_reach(periodic_model, full, "DiffTRe")
    free_model = mace.energy_fn_template(cfg, space.free()[0])
    assert free_model.periodic is False
    with pytest.raises(ValueError, match=r"built on free space \(space.free\(\)\), but the "
                                         r"simulation is periodic"):
        check_reach(free_model, full, "DiffTRe")
    from chemtrain import neighbors
    free_list = neighbors.neighbor_list(space.free()[0], None, 0.4).allocate(R)
    check_reach(free_model, free_list, "a molecule")   # free space with a free list is fine


def test_difftre_refuses_a_model_reaching_past_the_list(tmp_path):
    displacement, shift = space.periodic(BOX)
    trainer = Difftre({"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(0.99)},
                      optax.adam(1e-3), checkpoint_path=str(tmp_path),
                      options=RunOptions(progress=False))
    with pytest.raises(ValueError, match=r"State point 0: the energy model reaches 0.9 nm, but the "
                                         r"neighbor list holds pairs only up to 0.5 nm"):
        trainer.add_statepoint(
            lennard_jones_template(displacement, 0.9),
            functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.005, kT=1.0, gamma=1.0),
            partition.neighbor_list(displacement, BOX, 0.5,
                                    format=partition.NeighborListFormat.Sparse),
            process_printouts(0.005, 0.1, 0.05, 0.01), {"kT": 1.0, "mass": 40.0},
            {"energy": lambda state, **kw: kw["energy_fn"](state.position,
                                                          neighbor=kw["neighbor"])},
            lattice(), targets={"energy": {"target": 0.0, "gamma": 1.0}})


def _lj_statepoint(trainer, template, reference, **state_kwargs):
    displacement, shift = space.periodic(BOX)
    trainer.add_statepoint(
        template,
        functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.005, kT=1.0, gamma=1.0),
        partition.neighbor_list(displacement, BOX, 0.9, format=partition.NeighborListFormat.Sparse),
        process_printouts(0.005, 0.1, 0.05, 0.01), {"kT": 1.0, "mass": 40.0, **state_kwargs},
        {"energy": lambda state, **kw: kw["energy_fn"](state.position, neighbor=kw["neighbor"])},
        reference, targets={"energy": {"target": 0.0, "gamma": 1.0}})


def test_difftre_reference_state_in_angstrom_is_named(tmp_path):
    """A reference state in Å for a model in nm used to be blamed on 'the
    potential or the time step'."""
    displacement, _ = space.periodic(BOX)
    trainer = Difftre({"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(0.99)},
                      optax.adam(1e-3), checkpoint_path=str(tmp_path),
                      options=RunOptions(progress=False))
    with pytest.raises(ValueError, match=r"State point 0: the reference state spans .* box "
                                         r"lengths\): positions in other units than the model's "
                                         r"\(Å for nm: divide by 10\)"):
        _lj_statepoint(trainer, lennard_jones_template(displacement, 0.9), 10.0 * lattice())


def test_mace_species_of_the_wrong_shape_are_named(tmp_path):
    """species of shape (1, 26) for 27 atoms gave a numpy broadcast error."""
    cfg = random_config([18], 10.0, 1.0, num_channels=4, r_max=4.0, radial_MLP=[8])
    displacement, _ = space.periodic(BOX)
    trainer = Difftre(mace.init_params(cfg, __import__("jax").random.PRNGKey(0)),
                      optax.adam(1e-3), checkpoint_path=str(tmp_path),
                      options=RunOptions(progress=False))
    with pytest.raises(ValueError, match=r"State point 0: state_kwargs\['species'\] has shape "
                                         r"\(1, 26\), but the reference state has 27 particles; "
                                         r"give one value per particle, shape \(27,\)"):
        _lj_statepoint(trainer, mace.energy_fn_template(cfg, displacement), lattice(),
                       species=np.full((1, 26), 18))

"""Priors (chemtrain.models.prior): the repulsive prior against its formula,
sums of templates against their parts, and a frozen prior that stays
bitwise unchanged while the rest trains (relative entropy on the bonded
molecules of examples/relative_entropy)."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, space

from chemtrain.models import freeze, lennard_jones_template, repulsive_template, sum_templates
from paths import EXAMPLES

sys.path.insert(0, os.path.join(EXAMPLES,
                                "relative_entropy"))
import cg_bond_and_lj as ex  # noqa: E402

BOX = 5.0


def pair_at(r):
    return jnp.array([[1.0, 1.0, 1.0], [1.0 + r, 1.0, 1.0]])


@pytest.fixture(scope="module")
def system():
    displacement, _ = space.periodic(BOX)
    nbr_fn = partition.neighbor_list(displacement, BOX, 1.0,
                                     format=partition.NeighborListFormat.Dense)
    return displacement, nbr_fn


def energy(template, params, nbr_fn, r):
    R = pair_at(r)
    return float(template(params)(R, neighbor=nbr_fn.allocate(R)))


def test_repulsive_prior_is_its_formula_and_switches_off(system):
    displacement, nbr_fn = system
    prior = repulsive_template(displacement, r_cutoff=0.8, r_onset=0.6)
    p = {"sigma": 0.3, "epsilon": 1.5}
    for r in (0.25, 0.4, 0.59):   # below the onset: the bare repulsion
        assert energy(prior, p, nbr_fn, r) == pytest.approx(1.5 * (0.3 / r) ** 12, rel=1e-6)
    assert energy(prior, p, nbr_fn, 0.81) == 0.0
    inside = [energy(prior, p, nbr_fn, r) for r in np.linspace(0.6, 0.8, 21)]
    assert np.all(np.diff(inside) <= 0) and inside[-1] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="0 < r_onset < r_cutoff"):
        repulsive_template(displacement, r_cutoff=0.8, r_onset=0.9)


def test_sum_of_templates_is_the_sum_of_its_parts(system):
    displacement, nbr_fn = system
    lj = lennard_jones_template(displacement, 0.9)
    prior = repulsive_template(displacement, 0.8)
    both = sum_templates({"prior": prior, "lj": lj})
    p = {"prior": {"sigma": 0.3, "epsilon": 1.0}, "lj": {"sigma": 0.34, "epsilon": 0.99}}
    for r in (0.3, 0.38, 0.7):
        want = energy(prior, p["prior"], nbr_fn, r) + energy(lj, p["lj"], nbr_fn, r)
        assert energy(both, p, nbr_fn, r) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match=r"missing \['lj'\]"):
        both({"prior": p["prior"]})
    with pytest.raises(ValueError, match=r"not entries of the parameters"):
        freeze(optax.sgd(0.1), p, ["priors"])


def test_bad_parts_and_names_are_clear_errors(system):
    """Issue 37: names that collide as strings, a string for one frozen name,
    other parameter structures and a missing prior parameter."""
    displacement, nbr_fn = system
    lj = lennard_jones_template(displacement, 0.9)
    prior = repulsive_template(displacement, 0.8)
    with pytest.raises(ValueError, match=r"non-empty strings .*\[1\]"):
        sum_templates({1: prior, "1": lj})   # before: both became "1", the prior was lost
    with pytest.raises(ValueError, match=r"missing \['epsilon'\]"):
        prior({"sigma": 0.3})
    p = {"prior": {"sigma": 0.3, "epsilon": 1.0}, "lj": {"sigma": 0.34, "epsilon": 0.99}}
    one = freeze(optax.sgd(0.1), p, "prior")   # before: frozen ['i', 'o', 'p', 'r']
    grads = jax.tree.map(lambda v: 1.0, p)
    updates, _ = one.update(grads, one.init(p), p)
    assert updates["prior"] == {"sigma": 0.0, "epsilon": 0.0}
    assert updates["lj"]["sigma"] == pytest.approx(-0.1)
    with pytest.raises(ValueError, match=r"params must be the dict"):
        freeze(optax.sgd(0.1), [p], ["prior"])
    with pytest.raises(ValueError, match=r"frozen must be names"):
        freeze(optax.sgd(0.1), p, [0])


def test_parts_of_the_wrong_kind_are_named(system):
    """Issue 37: a part giving per-particle energies, or a template that
    returns jax-md's (neighbor_fn, energy_fn) pair, and freeze used on
    parameters other than those it was built on, gave raw jax/Type errors."""
    from jax_md import energy as jmd
    displacement, nbr_fn = system
    prior = repulsive_template(displacement, 0.8)
    lj = lennard_jones_template(displacement, 0.9)
    p = {"prior": {"sigma": 0.3, "epsilon": 1.0}, "lj": {"sigma": 0.34, "epsilon": 0.99}}

    def per_particle(params):
        full = lj(params)
        return lambda R, neighbor=None, **kw: jnp.full(R.shape[0], full(R, neighbor=neighbor) / 2)
    with pytest.raises(ValueError, match=r"part 'lj' returns an energy of shape \(2,\), not one "
                                         r"number: per-particle energies\?"):
        energy(sum_templates({"prior": prior, "lj": per_particle}), p, nbr_fn, 0.38)

    def jax_md_pair(params):
        return jmd.lennard_jones_neighbor_list(displacement, BOX, sigma=params["sigma"],
                                               epsilon=params["epsilon"])
    with pytest.raises(TypeError, match=r"part 'lj''s template returned tuple \(jax-md's "
                                        r"\(neighbor_fn, energy_fn\) pair\? take its energy_fn\)"):
        sum_templates({"prior": prior, "lj": jax_md_pair})(p)
    opt = freeze(optax.adam(1e-3), p, ["prior"])
    other = {"prior": p["prior"], "mace": {"w": jnp.ones(3)}}
    with pytest.raises(ValueError, match=r"freeze was built on the parameters with entries "
                                         r"\['lj', 'prior'\], but the parameters have \['mace', "
                                         r"'prior'\]"):
        opt.init(other)
    state = opt.init(p)
    with pytest.raises(ValueError, match=r"but the updates have \['mace', 'prior'\]"):
        opt.update(other, state, p)


def test_frozen_prior_stays_bitwise_unchanged(tmp_path):
    with jax.enable_x64(True):
        tr, _ = ex.bond_trainer(0, frames=50, production=2.0, prior=True, progress=False,
                                checkpoint_path=str(tmp_path))
        before = jax.tree.map(np.asarray, tr.params)
        tr.train(3)
    for k, v in before["prior"].items():
        assert np.asarray(tr.params["prior"][k]).tobytes() == v.tobytes()
    assert abs(float(tr.params["bond"]["r_0"]) - 0.30) > 1e-3

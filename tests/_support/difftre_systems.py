"""Cheap DiffTRe systems shared by the in-process tests and the mpirun
scripts: two particles with a harmonic bond at several temperatures (2,100
Langevin steps and 100 snapshots per trajectory)."""
import functools

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, simulate, space

from chemtrain import quantity
from chemtrain.models.pair import harmonic_bond_template
from chemtrain.simulate import RestartPolicy, process_printouts
from chemtrain.trainers.difftre import DifftreParallel
from chemtrain.trainers.options import split_options

KTS = np.array([2.56, 3.0, 3.5, 3.2, 2.8, 2.7, 3.3])


def analytic_rdf(r, r_0=0.35, b=250.0, kT=2.56, box=1.0):
    """RDF of two particles bonded by ``b/2 (r - r_0)^2`` in a box of ``box``."""
    b = b / kT
    norm = np.sqrt(np.pi / (2 * b)) * (1 + b * r_0 ** 2) / b
    return box ** 3 / (16 * np.pi) * np.exp(-0.5 * b * (r - r_0) ** 2) / norm


def pair_system(box=1.0):
    """(displacement, shift, template on {'r_0', 'scaled_b'}, RDF bins, bin
    centers) of two particles bonded by 100 scaled_b / 2 (r - r_0)^2."""
    displacement, shift = space.periodic_general(box)
    base = harmonic_bond_template(displacement, [[0, 1]])
    template = lambda p: base({"k": 100 * p["scaled_b"], "r0": p["r_0"]})  # noqa: E731
    rdf_params = quantity.rdf_discretization(1.0, 50, 0.0)
    return displacement, shift, template, rdf_params, np.asarray(rdf_params.bin_centers)


def pair_rdf(displacement, rdf_params, box=1.0):
    """The RDF of the bonded pair as upstream chemtrain computes it: to 1 nm
    in the 1 nm box, each pair at its minimum-image distance."""
    return quantity.rdf(displacement, rdf_params, box=box, periodic_images="nearest")


def bonded_pair_args(n_statepoints=3, **kwargs):
    """Arguments of a DifftreParallel on two bonded particles at the first
    ``n_statepoints`` temperatures of ``KTS``; ``kwargs`` override them."""
    box = 1.0
    displacement, shift, template, rdf_params, r = pair_system(box)
    kTs = KTS[:n_statepoints]
    n = len(kTs)
    args = dict(
        key=jax.random.PRNGKey(3), init_params={"r_0": jnp.asarray(0.3), "scaled_b": jnp.asarray(1.5)},
        optimizer=optax.rmsprop(0.01), energy_fn_template=template,
        simulator_template=functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01,
                                             kT=2.56, gamma=0.5),
        neighbor_fn=partition.neighbor_list(displacement, box, 0.9,
                                            format=partition.NeighborListFormat.Dense),
        timings=process_printouts(0.01, 21.0, 1.0, 0.2),
        state_kwargs={"kT": kTs, "mass": np.full(n, 10.0)},
        quantities={"rdf": pair_rdf(displacement, rdf_params, box),
                    "energy": quantity.potential_energy()},
        targets={"rdf": {"target": np.stack([analytic_rdf(r, kT=k) for k in kTs]), "gamma": 1.0},
                 "energy": {"target": 0.5 * kTs, "gamma": 0.1}},
        reference_states=np.broadcast_to(np.array([[0.0, 0.0, 0.0], [0.11, 0.09, 0.12]]), (n, 2, 3)),
        sim_batch_size=1, reweight_ratio=0.99, progress=False)
    args.update(kwargs)
    return split_options(args)


def bonded_pair(n_statepoints=3, **kwargs):
    """DifftreParallel on two bonded particles (see :func:`bonded_pair_args`)."""
    return DifftreParallel(**bonded_pair_args(n_statepoints, **kwargs))


def update_recorder():
    """(records, on_update): pass ``on_update`` to the trainer; each applied
    update appends (state points of the batch, parameters before, after)."""
    records = []

    def on_update(r):
        records.append({"batch": list(r["batch"]),
                        "before": {k: float(v) for k, v in r["params_before"].items()},
                        "after": {k: float(v) for k, v in r["params_after"].items()}})
    return records, on_update


def overflowing_lj(**kwargs):
    """DifftreParallel on 128 Lennard-Jones particles started on a lattice
    with a neighbor list of no spare capacity and no retries: state point 1
    (argon at 120 K) overflows its list, state point 0 (1 K and a huge mass:
    frozen in place) does not."""
    from chemtrain.models.pair import lennard_jones_template
    from chemtrain.units import kT
    n, r_cut = 128, 0.9
    box = (n / 21.0) ** (1 / 3)
    displacement, shift = space.periodic(box)
    per = int(np.ceil(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    lattice = (grid + 0.5) * box / per
    rdf_bins = quantity.rdf_discretization(0.85, 130, 0.2)
    args = dict(
        key=jax.random.PRNGKey(0), init_params={"sigma": jnp.asarray(0.34),
                                                "epsilon": jnp.asarray(0.99)},
        optimizer=optax.sgd(1e-3), energy_fn_template=lennard_jones_template(displacement, r_cut),
        simulator_template=functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01,
                                             kT=kT(120.0), gamma=5.0),
        neighbor_fn=partition.neighbor_list(displacement, box, r_cut, dr_threshold=0.05,
                                            capacity_multiplier=1.0,
                                            format=partition.NeighborListFormat.Sparse),
        timings=process_printouts(0.01, 1.0, 0.5, 0.1),
        state_kwargs={"kT": np.array([kT(1.0), kT(120.0)]), "mass": np.array([1e6, 39.95])},
        quantities={"rdf": quantity.rdf(displacement, rdf_bins, box=box)},
        targets={"rdf": {"target": np.ones((2, 130))}},
        reference_states=np.broadcast_to(lattice, (2, n, 3)), sim_batch_size=-1,
        restart=RestartPolicy(max_retries=0), progress=False)
    args.update(kwargs)
    return DifftreParallel(**split_options(args))

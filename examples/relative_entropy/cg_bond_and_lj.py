"""Relative-entropy minimisation (``chemtrain.trainers.RelativeEntropy``) on
two systems whose answer is known.

    python examples/relative_entropy/cg_bond_and_lj.py [--system bond|lj|both] [--seed 0] [--out relentropy]

(a) ``bond``: 16 two-bead molecules with a harmonic bond ``100 b / 2 (r -
    r_0)^2`` (true r_0 = 0.35 nm, b = 2.5, kT = 2.56 kJ/mol) in a 3 nm box.
    The reference configurations are drawn from the exact bond-length
    distribution ``r^2 exp(-100 b (r - r_0)^2 / 2kT)`` with random
    orientations: no simulation of the reference. Training starts at r_0 =
    0.30, b = 1.5.
(b) ``lj``: a Lennard-Jones fluid (108 particles, argon-like: sigma 0.34 nm,
    epsilon 0.99 kJ/mol, 21 nm^-3). The reference configurations
    at 90 and 160 K come from our own simulation at the true parameters.
    Training starts 5 % below sigma and 20 % above epsilon, in the
    coordinates of :func:`lj_coordinates`.

Both use Langevin dynamics, trajectories of 100 snapshots reused by
reweighting while N_eff stays high (98 % for the bonds: a trajectory reused
near the optimum would pin the answer to its own sampling error; 90 % for
the fluid), Adam with a decaying step, and
print the recovered parameters against the truth. Writes under ``--out``
per system: ``metrics.jsonl`` (one line per epoch: the relative-entropy
change since the start, gradient norms, N_eff) and ``relentropy.png``. A
few minutes on two CPU cores; the suite runs both as tests
(tests/trainers/test_relative_entropy.py).
"""
from __future__ import annotations

import argparse
import functools
import os
import time

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, simulate, space

from chemtrain.models import (freeze, harmonic_bond_template, lennard_jones_template,
                              repulsive_template, sum_templates)
from chemtrain.simulate import make_trajectory, process_printouts
from chemtrain.trainers import RelativeEntropy
from chemtrain.trainers.options import split_options
from chemtrain.units import kT as kT_of

BOND = {"r_0": 0.35, "b": 2.5, "kT": 2.56, "molecules": 16, "box": 3.0, "mass": 10.0}
BOND_OPTIONS = {"reweight_ratio": 0.98}
LJ = {"sigma": 0.34, "epsilon": 0.99, "n": 108, "density": 21.0, "mass": 39.95,
      "r_cut": 0.8, "temperatures": (90.0, 160.0)}
LJ_OPTIONS = {"sim_batch_size": -1}


def exact_bond_frames(n_frames, seed, r_0=BOND["r_0"], b=BOND["b"], kT=BOND["kT"],
                      molecules=BOND["molecules"], box=BOND["box"]):
    """``n_frames`` configurations of ``molecules`` independent bonded pairs,
    each bond length drawn from its exact distribution by inverting the
    cumulative distribution on a fine grid, each orientation and centre
    uniformly."""
    rng = np.random.default_rng(seed)
    r = np.linspace(1e-4, r_0 + 12 * np.sqrt(kT / (100 * b)), 40001)
    density = r ** 2 * np.exp(-100 * b * (r - r_0) ** 2 / (2 * kT))
    cdf = np.cumsum(density)
    lengths = np.interp(rng.random((n_frames, molecules)), cdf / cdf[-1], r)
    u = rng.normal(size=(n_frames, molecules, 3))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    first = rng.random((n_frames, molecules, 3)) * box
    pairs = np.stack([first, first + lengths[..., None] * u], axis=2)
    return (pairs.reshape(n_frames, 2 * molecules, 3) % box).astype(np.float64)


def relative_entropy(params, optimizer, seed, options: dict):
    """A RelativeEntropy trainer; ``options`` are its keywords and the
    fields of :class:`~chemtrain.trainers.RunOptions` (``progress``,
    ``log_file``, ``plot_file``, ...) side by side."""
    return RelativeEntropy(params, optimizer, key=seed, **split_options(options))


def bond_trainer(seed=0, updates=200, kTs=(BOND["kT"],), frames=1000, production=10.0,
                 optimizer=None, prior=False, reference_data=None, initialize=True,
                 **options):
    """(trainer, truth) of system (a), one state point per ``kTs`` entry
    (``frames`` reference configurations each, trajectories of
    ``production`` ps); ``options`` go to RelativeEntropy. With ``prior``
    the model is a frozen repulsive prior plus the bond (parameters
    ``{'prior': ..., 'bond': ...}``), as one trains an ML potential.
    ``reference_data`` replaces the first state point's drawn frames (an
    array or a loader); ``initialize=False`` samples no trajectory yet."""
    box, m = BOND["box"], BOND["molecules"]
    displacement, shift = space.periodic(box)
    base = harmonic_bond_template(displacement, [[2 * i, 2 * i + 1] for i in range(m)])

    def template(p):
        return base({"k": 100 * p["b"], "r0": p["r_0"]})
    # the bonds read no neighbors, but the simulator needs a list
    neighbor_fn = partition.neighbor_list(displacement, box, 1.0, capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    params = {"r_0": jnp.asarray(0.30), "b": jnp.asarray(1.5)}
    optimizer = optimizer or optax.adam(optax.exponential_decay(0.03, updates, 0.2))
    if prior:
        template = sum_templates({"prior": repulsive_template(displacement, 0.3),
                                  "bond": template})
        params = {"prior": {"sigma": jnp.asarray(0.1), "epsilon": jnp.asarray(0.5)},
                  "bond": params}
        optimizer = freeze(optimizer, params, ["prior"])
    trainer = relative_entropy(params, optimizer, seed, dict(BOND_OPTIONS, **options))
    simulator = functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01, kT=kTs[0],
                                  gamma=2.0)
    for i, kT in enumerate(kTs):
        reference = exact_bond_frames(frames, seed + 100 * i, kT=kT)
        data = reference_data if i == 0 and reference_data is not None else reference
        trainer.add_statepoint(data, template, simulator, neighbor_fn,
                               process_printouts(0.01, production + 1.0, 1.0, 0.1),
                               {"kT": kT, "mass": BOND["mass"]}, reference[0],
                               reference_batch_size=min(100, data.n if hasattr(data, "n") else len(data)),
                               initialize_traj=initialize)
    return trainer, {"r_0": BOND["r_0"], "b": BOND["b"]}


def lattice(n, box):
    per = int(np.ceil(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return (grid + 0.5) * box / per


def lj_coordinates(sigma, epsilon) -> dict:
    """The trained coordinates of the LJ fluid: ``log_d = log sigma + log
    epsilon / 12`` and ``log_epsilon``. A dense liquid's structure pins its
    repulsive core, whose effective diameter goes as sigma epsilon^(1/12) for
    an r^-12 wall, and barely sees the attraction: in (log sigma, log
    epsilon) the relative entropy is a long narrow valley along that
    diameter, which first-order optimisers crawl along; in these coordinates
    the stiff and the shallow direction are the two axes."""
    return {"log_d": jnp.log(sigma) + jnp.log(epsilon) / 12, "log_epsilon": jnp.log(epsilon)}


def lj_parameters(p) -> dict:
    """sigma and epsilon of :func:`lj_coordinates`."""
    return {"sigma": jnp.exp(p["log_d"] - p["log_epsilon"] / 12),
            "epsilon": jnp.exp(p["log_epsilon"])}


def lj_reference(n_frames, seed, temperature, shift, box, neighbor_fn, template):
    """``n_frames`` configurations of the LJ fluid at the true parameters and
    ``temperature``, one every 0.2 ps after 10 ps of equilibration, from our
    own Langevin simulation (the same generator the trainer uses)."""
    timings = process_printouts(0.01, 10.0 + 0.2 * n_frames, 10.0, 0.2)
    init, run = make_trajectory(
        functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01, kT=kT_of(temperature),
                          gamma=5.0), template, neighbor_fn, timings)
    params = lj_coordinates(LJ["sigma"], LJ["epsilon"])
    kw = {"kT": kT_of(temperature), "mass": LJ["mass"]}
    key = jax.random.PRNGKey(1000 + seed)
    state = init(params, key, jnp.asarray(lattice(LJ["n"], box)), **kw)
    state = run(params, state, jax.random.fold_in(key, 1), **kw)
    return np.asarray(state.snapshots.position)


def lj_trainer(seed=0, updates=80, start=(0.95, 1.2), optimizer=None, **options):
    """(trainer, truth) of system (b), one state point per temperature of
    ``LJ``, started at ``start`` times the true sigma and epsilon;
    ``options`` go to RelativeEntropy."""
    box = (LJ["n"] / LJ["density"]) ** (1 / 3)
    displacement, shift = space.periodic(box)
    base = lennard_jones_template(displacement, LJ["r_cut"])

    def template(p):
        return base(lj_parameters(p))
    neighbor_fn = partition.neighbor_list(displacement, box, LJ["r_cut"], dr_threshold=0.05,
                                          format=partition.NeighborListFormat.Sparse)
    adam = optax.adam(optax.exponential_decay(0.03, updates, 0.1))
    init = lj_coordinates(start[0] * LJ["sigma"], start[1] * LJ["epsilon"])
    trainer = relative_entropy(init, optimizer or adam, seed, dict(LJ_OPTIONS, **options))
    simulator = functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01,
                                  kT=kT_of(LJ["temperatures"][0]), gamma=5.0)
    for temperature in LJ["temperatures"]:
        reference = lj_reference(200, seed, temperature, shift, box, neighbor_fn, template)
        trainer.add_statepoint(reference, template, simulator, neighbor_fn,
                               process_printouts(0.01, 6.0, 1.0, 0.05),
                               {"kT": kT_of(temperature), "mass": LJ["mass"]}, reference[-1],
                               reference_batch_size=50)
    return trainer, {"sigma": LJ["sigma"], "epsilon": LJ["epsilon"]}


def recovered(trainer) -> dict:
    """The trained parameters in the truth's names."""
    p = trainer.params.get("bond", trainer.params)   # without a prior
    p = {k: float(v) for k, v in p.items()}
    if "log_d" in p:
        return {k: float(v) for k, v in lj_parameters(p).items()}
    return p


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--system", choices=("bond", "lj", "both"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="relentropy")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    systems = {"bond": (bond_trainer, 200), "lj": (lj_trainer, 80)}
    for name in (("bond", "lj") if args.system == "both" else (args.system,)):
        make, updates = systems[name]
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        started = time.perf_counter()
        trainer, truth = make(args.seed, updates, log_file=os.path.join(folder, "metrics.jsonl"),
                              checkpoint_path=os.path.join(folder, "checkpoints"))
        trainer.train(updates)
        trainer.plot(os.path.join(folder, "relentropy.png"))
        got = recovered(trainer)
        print(f"\n({name}) {updates} updates in {time.perf_counter() - started:.0f} s; "
              f"S_rel change {trainer.epoch_losses[-1]:.4g}")
        for k, v in truth.items():
            print(f"  {k:8s} true {v:.4f}  recovered {got[k]:.4f}  ({100 * (got[k] / v - 1):+.2f} %)")


if __name__ == "__main__":
    main()

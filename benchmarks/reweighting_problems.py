"""Reweighting problems with known answers (issue 31), shared by
``benchmarks/reweighting_known_answers.py``, the upstream side-by-side script
``benchmarks/upstream/relentropy_bond.py`` and the tests.

The module level is numpy only, so upstream chemtrain's own venv can import
the problem's constants and reference frames; the trainer builders import
this project's chemtrain when called.

``BOND``: two beads with a harmonic bond ``kb / 2 (r - b0)^2``, b0 0.154 nm,
kb 4e4 kJ/mol/nm^2, kT 2.56 kJ/mol, mass 15, in a 1 nm periodic box;
Langevin dt 1 fs, gamma 5/ps, trajectories of 22 ps (2 ps equilibration,
a snapshot every 20 fs: 1,000 snapshots); the model is the bond on log
parameters started at b0 0.13 and kb 1e5; Adam with a learning rate 0.05
decaying exponentially to 0.01 over 400 updates.

- Relative entropy: 4,000 reference configurations drawn from the exact
  bond-length distribution ``r^2 exp(-U / kT)`` (no simulation), a batch of
  1,000 per update.
- DiffTRe: the targets are the exact means of ``x = (r - 0.154) / 0.008``
  and ``x^2`` under that distribution, so the loss's minimum lies exactly at
  the true b0 and kb (two equations, two unknowns).
"""
from __future__ import annotations

import functools

import numpy as np

BOND = {"b0": 0.154, "kb": 4e4, "kT": 2.56, "mass": 15.0, "box": 1.0,
        "start": (0.13, 1e5), "dt": 0.001, "gamma": 5.0, "total": 22.0,
        "equilibration": 2.0, "print_every": 0.02, "lr": 0.05, "decay_steps": 400,
        "decay": 0.2, "frames": 4000, "reference_batch": 1000,
        "x_centre": 0.154, "x_scale": 0.008}


def _grid(b0, kb, kT):
    s = np.sqrt(kT / kb)
    r = np.linspace(max(1e-4, b0 - 12 * s), b0 + 12 * s, 40001)
    return r, r ** 2 * np.exp(-kb * (r - b0) ** 2 / (2 * kT))


def exact_bond_frames(n_frames: int, seed: int, b0=BOND["b0"], kb=BOND["kb"], kT=BOND["kT"],
                      box=BOND["box"]):
    """``(R, r)``: ``n_frames`` configurations of the two beads (frames, 2, 3),
    each bond length ``r`` drawn from ``r^2 exp(-kb (r - b0)^2 / 2 kT)`` by
    inverting its cumulative distribution on a fine grid, orientation and
    position uniform."""
    rng = np.random.default_rng(1234 + seed)
    r, density = _grid(b0, kb, kT)
    cdf = np.cumsum(density)
    lengths = np.interp(rng.random(n_frames), cdf / cdf[-1], r)
    u = rng.normal(size=(n_frames, 3))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    first = rng.random((n_frames, 3)) * box
    R = np.stack([first, first + lengths[:, None] * u], axis=1) % box
    return R.astype(np.float64), lengths


def exact_bond_moments(b0=BOND["b0"], kb=BOND["kb"], kT=BOND["kT"]):
    """Exact ``(<x>, <x^2>)`` of ``x = (r - x_centre) / x_scale`` (quadrature)."""
    r, density = _grid(b0, kb, kT)
    p = density / density.sum()
    x = (r - BOND["x_centre"]) / BOND["x_scale"]
    return float(p @ x), float(p @ x ** 2)


def relative_entropy_optimum(lengths):
    """``(b0, kb)`` minimising the relative entropy to the reference bond
    lengths ``lengths`` exactly (maximum likelihood of the model family
    ``r^2 exp(-kb (r - b0)^2 / 2 kT)``, normalised by quadrature): the best
    any trainer can reach on that reference."""
    from scipy.optimize import minimize
    kT = BOND["kT"]

    def nll(x):
        b0, kb = np.exp(x)
        r, density = _grid(b0, kb, kT)
        log_z = np.log(np.sum(density) * (r[1] - r[0]))
        return np.mean(kb * (lengths - b0) ** 2 / (2 * kT) - 2 * np.log(lengths)) + log_z
    res = minimize(nll, np.log([BOND["b0"], BOND["kb"]]), method="Nelder-Mead",
                   options={"xatol": 1e-9, "fatol": 1e-12})
    return tuple(float(v) for v in np.exp(res.x))


# -- this project's trainers on the problem (import chemtrain when called) ---------

def _bond_system():
    import jax.numpy as jnp
    from jax_md import partition, simulate, space

    from chemtrain.models import harmonic_bond_template
    from chemtrain.simulate import process_printouts
    box = BOND["box"]
    displacement, shift = space.periodic(box)
    base = harmonic_bond_template(displacement, [[0, 1]])

    def template(p):
        return base({"k": jnp.exp(p["log_kb"]), "r0": jnp.exp(p["log_b0"])})
    neighbor_fn = partition.neighbor_list(displacement, box, 0.3,
                                          format=partition.NeighborListFormat.Sparse)
    simulator = functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=BOND["dt"],
                                  kT=BOND["kT"], gamma=BOND["gamma"])
    timings = process_printouts(BOND["dt"], BOND["total"], BOND["equilibration"],
                                BOND["print_every"])
    params = {"log_b0": jnp.log(BOND["start"][0]), "log_kb": jnp.log(BOND["start"][1])}
    return displacement, template, neighbor_fn, simulator, timings, params


def bond_optimizer():
    import optax
    return optax.adam(optax.exponential_decay(BOND["lr"], BOND["decay_steps"], BOND["decay"]))


def bond_params(params) -> dict:
    """``{'b0', 'kb'}`` of the trained log parameters."""
    return {"b0": float(np.exp(params["log_b0"])), "kb": float(np.exp(params["log_kb"]))}


def relative_entropy_bond(seed: int = 0, **options):
    """``(trainer, reference bond lengths)``: RelativeEntropy on ``BOND``;
    ``options`` go to the trainer (e.g. ``reweight_ratio``, ``max_reuse_se``,
    ``checkpoint_path``, ``on_update``)."""
    from chemtrain.trainers import RelativeEntropy
    from chemtrain.trainers.options import split_options
    _, template, neighbor_fn, simulator, timings, params = _bond_system()
    R, lengths = exact_bond_frames(BOND["frames"], seed)
    trainer = RelativeEntropy(params, bond_optimizer(), key=seed, **split_options(options))
    trainer.add_statepoint(R, template, simulator, neighbor_fn, timings,
                           {"kT": BOND["kT"], "mass": BOND["mass"]}, R[0],
                           reference_batch_size=BOND["reference_batch"], vmap_batch=100)
    return trainer, lengths


def difftre_bond(seed: int = 0, **options):
    """DiffTRe (``Difftre``) on ``BOND`` with the exact moment targets of
    :func:`exact_bond_moments`; ``options`` go to the trainer."""
    import jax
    import jax.numpy as jnp

    from chemtrain.trainers import Difftre
    from chemtrain.trainers.options import split_options
    displacement, template, neighbor_fn, simulator, timings, params = _bond_system()
    c, s = BOND["x_centre"], BOND["x_scale"]

    def x_of(state, **unused):
        d = displacement(state.position[1], state.position[0])
        return (jnp.sqrt(jnp.sum(d * d)) - c) / s
    quantities = {"x": x_of, "x2": lambda state, **kw: x_of(state) ** 2}
    m1, m2 = exact_bond_moments()
    R0 = exact_bond_frames(1, seed)[0][0]
    trainer = Difftre(params, bond_optimizer(), key=jax.random.PRNGKey(seed),
                      **split_options(options))
    trainer.add_statepoint(template, simulator, neighbor_fn, timings,
                           {"kT": BOND["kT"], "mass": BOND["mass"]}, quantities, R0,
                           targets={"x": {"target": m1, "gamma": 1.0},
                                    "x2": {"target": m2, "gamma": 1.0}}, vmap_batch=100)
    return trainer

"""The harmonic-wells system of tests/learn/test_dynamics.py, and one MPI
rank of its two-rank test.

    mpirun -np N python tests/_support/mp_dynamics.py --out DIR

Particles in harmonic wells k/2 |r - site|^2, whose canonical normalised
velocity autocorrelation is cos(t sqrt(k/m)): the dynamics objective learns
k from that curve at each of ``kTs`` (one state point per temperature, all
in every update, one per rank under ``mpirun -np 2``). Every rank writes its
parameters and losses to DIR/result_<rank>.json.
"""
import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

L, MASS, DT, K_TRUE = 3.0, 10.0, 0.005, 400.0


def wells_trainer(folder, kTs=(2.5,), lr=None, sim_batch_size=1, seed=0, prior_k=None,
                  static=False):
    """A Reweighting loop with the dynamics objective on 27 particles in
    harmonic wells (k = 100 scaled_k, from scaled_k = 3), 1 ps segments
    from 16 snapshots per trajectory, one state point per kT. ``prior_k``:
    the wells are a fixed prior of that stiffness plus the trained ones
    (``sum_templates``; parameters ``{'wells': ..., 'prior': {}}``), so the
    curve's k = 400 is reached at scaled_k = (400 - prior_k) / 100.
    ``static``: also a static target, the mean squared distance of a
    particle from its site, 3 kT / k (DiffTRe's part of the loss)."""
    import chemtrain  # noqa: F401  (before jax_md)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax_md import partition, simulate, space

    from chemtrain.learn import ReuseRule, dynamics_objective, make_segment, simulation_functions
    from chemtrain.simulate import process_printouts
    from chemtrain.trainers import Reweighting, RunOptions

    disp, shift = space.periodic(L)
    g = (np.arange(3) + 0.5) * (L / 3)
    sites = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)

    def template(p):
        def energy(R, neighbor=None, **kw):
            d = jax.vmap(disp)(R, jnp.asarray(sites, R.dtype))
            return 0.5 * 100.0 * p["scaled_k"] * jnp.sum(d ** 2)
        return energy
    params = {"scaled_k": jnp.asarray(3.0)}
    if prior_k is not None:
        from chemtrain.models.prior import sum_templates

        def prior(p):
            def energy(R, neighbor=None, **kw):
                d = jax.vmap(disp)(R, jnp.asarray(sites, R.dtype))
                return 0.5 * prior_k * jnp.sum(d ** 2)
            return energy
        template = sum_templates({"wells": template, "prior": prior})
        params = {"wells": params, "prior": {}}
    t = DT * np.arange(201)
    target = np.cos(np.sqrt(K_TRUE / MASS) * t)
    tr = Reweighting(dynamics_objective(), seed, params,
                     optax.adam(lr or optax.cosine_decay_schedule(0.08, 40)),
                     reuse=ReuseRule(pool=1), sim_batch_size=sim_batch_size,
                     options=RunOptions(progress=False, checkpoint_path=folder))
    fns = simulation_functions(template, functools.partial(
        simulate.nvt_langevin, shift_fn=shift, dt=DT, kT=float(kTs[0]), gamma=2.0),
        partition.neighbor_list(disp, L, 0.3, format=partition.NeighborListFormat.Dense),
        process_printouts(DT, 6.0, 2.0, 0.25), None)
    spec = {"segment": make_segment(template, shift, DT, 200),
            "functionals": {"vacf": lambda series, dt: series["vacf"] / series["vacf"][0]},
            "targets": {"vacf": {"gamma": 10.0}}}
    values = {"vacf": target}
    if static:
        def r2(state, neighbor=None, energy_fn=None, **kw):
            return jnp.mean(jnp.sum(jax.vmap(disp)(state.position, jnp.asarray(
                sites, state.position.dtype)) ** 2, -1))
        spec["quantities"] = {"r2": r2}
        spec["targets"] = dict(spec["targets"], r2={"gamma": 1e5})
    first = None
    for kT in kTs:
        if static:
            values = dict(values, r2=3 * float(kT) / K_TRUE)
        sp = tr.add(fns, {"kT": float(kT), "mass": MASS}, sites, targets=spec["targets"],
                    target_values=values, n_snapshots=16, spec=spec, like=first)
        first = first or sp
    return tr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    tr = wells_trainer(os.path.join(args.out, "run"), kTs=(2.5, 3.5), sim_batch_size=-1)
    tr.initialize_trajstates()
    tr.train(3)
    with open(os.path.join(args.out, f"result_{rank}.json"), "w") as f:
        json.dump({"k": float(tr.params["scaled_k"]), "losses": tr.update_losses}, f)


if __name__ == "__main__":
    main()

"""One MPI rank of tests/learn/test_objective.py, and the trainer it builds.

    mpirun -np N python tests/_support/mp_objective.py --out DIR

Trains the mean-energy objective (mean_energy.py) on the bonded pair at two
temperatures, both state points in every update (one per rank under
``mpirun -np 2``); every rank writes its parameters and its trajectories'
bond energies to DIR/result_<rank>.json.
"""
import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: target mean energies (kJ/mol) of the two state points, and their kT
TARGETS, KTS = (2.0, 2.6), (2.56, 3.0)


def trainer(folder, updates=12, max_reuses=None):
    """(trainer, bond energies of a state point's trajectory): a Reweighting
    loop with the mean-energy objective on a bonded pair whose energy is the
    bond plus a trained constant ``shift``, trained ``updates`` updates;
    trajectories are recomputed only after ``max_reuses`` reuses (None:
    never)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax_md import partition, simulate

    from chemtrain.learn import ReuseRule, simulation_functions
    from chemtrain.simulate import process_printouts
    from chemtrain.trainers import Reweighting, RunOptions
    from difftre_systems import pair_system
    from mean_energy import mean_energy_objective

    displacement, shift, bond, _, _ = pair_system(1.0)
    fixed = {"r_0": jnp.asarray(0.3), "scaled_b": jnp.asarray(1.5)}

    def template(p):
        def energy(R, neighbor=None, **kwargs):
            return bond(fixed)(R, neighbor=neighbor, **kwargs) + p["shift"]
        return energy
    tr = Reweighting(mean_energy_objective(), 7, {"shift": jnp.asarray(0.0)},
                     optax.sgd(0.25), sim_batch_size=-1, reuse=ReuseRule(max_reuse_se=None, max_reuses=max_reuses, reweight_ratio=0.0),
                     options=RunOptions(progress=False, checkpoint_path=folder))
    fns = simulation_functions(template, functools.partial(
        simulate.nvt_langevin, shift_fn=shift, dt=0.01, kT=2.56, gamma=0.5),
        partition.neighbor_list(displacement, 1.0, 0.9, format=partition.NeighborListFormat.Dense),
        process_printouts(0.01, 21.0, 1.0, 0.2), None)
    first = None
    for kT, target in zip(KTS, TARGETS):
        sp = tr.add(fns, {"kT": kT, "mass": 10.0},
                    np.array([[0.0, 0.0, 0.0], [0.11, 0.09, 0.12]]),
                    targets={"mean_energy": {}}, target_values={"mean_energy": target},
                    n_snapshots=100, like=first)
        first = first or sp
    tr.initialize_trajstates(num_runs=2)
    if updates:
        tr.train(updates)

    def bond_energies(i, trajs=None):
        positions = (trajs or tr.trajstates[i])[0].snapshots.position
        return [float(jax.jit(lambda R: bond(fixed)(R))(R)) for R in positions]
    return tr, bond_energies


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
    tr, bond_energies = trainer(os.path.join(args.out, "run"))
    with open(os.path.join(args.out, f"result_{rank}.json"), "w") as f:
        json.dump({"shift": float(tr.params["shift"]), "losses": tr.update_losses,
                   "bond": [bond_energies(i) for i in range(len(KTS))]}, f)


if __name__ == "__main__":
    main()

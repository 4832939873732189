"""ForceMatching step time vs a hand-written jitted optax step (one device).

    .venv/bin/python benchmarks/overhead.py [--batch 16] [--epochs 3] [--repeats 3]

Both train the same MLP pair potential on the same jax-md Lennard-Jones frames
with the same batches (numpy slicing and device_put included in both). The
hand-written loop is the minimum a user would write: one jitted function that
predicts energies and forces, takes the loss and applies optax.adam. Compile
time is excluded (one warm-up epoch each). Prints per-step times and the ratio
(target: at most 1.05).
"""
import argparse
import logging
import time

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, space

from chemtrain.models import init_pair_mlp, pair_mlp_template
from chemtrain.simulate import lj_fluid_dataset
from chemtrain.trainers import ForceMatching, RunOptions


def hand_written(params, template, nbrs_init, data, batch, epochs, gammas):
    opt = optax.adam(1e-3)

    def loss_fn(p, R, U, F):
        def one(r):
            nb = nbrs_init.update(r)
            e, g = jax.value_and_grad(lambda x: template(p)(x, neighbor=nb))(r)
            return e, -g
        u, f = jax.vmap(one)(R)
        return gammas["U"] * jnp.mean((u - U) ** 2) + gammas["F"] * jnp.mean((f - F) ** 2)

    @jax.jit
    def step(p, s, R, U, F):
        loss, g = jax.value_and_grad(loss_fn)(p, R, U, F)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    state = opt.init(params)
    n = data["R"].shape[0] // batch
    dev = jax.devices()[0]
    times = []
    for epoch in range(epochs + 1):
        order = np.random.default_rng([0, epoch]).permutation(data["R"].shape[0])
        t = time.perf_counter()
        losses = []
        for b in range(n):
            idx = order[b * batch:(b + 1) * batch]
            R, U, F = jax.device_put((data["R"][idx], data["U"][idx], data["F"][idx]), dev)
            params, state, loss = step(params, state, R, U, F)
            losses.append(loss)
        np.asarray(jnp.stack(losses))
        times.append((time.perf_counter() - t) / n)
    return times[1:]


def chemtrain_steps(params, template, nbrs_init, data, batch, epochs, gammas):
    tr = ForceMatching(params, optax.adam(1e-3), template, nbrs_init, batch=batch,
                       parallelism="single", gammas=gammas, checkpoint_path="/tmp/chemtrain-bench",
                       options=RunOptions(progress=False))
    tr.set_dataset(data, "training")
    tr.train(1)  # warm-up and compile
    times = []
    for _ in range(epochs):
        t = time.perf_counter()
        tr.train(1)
        times.append((time.perf_counter() - t) / (data["R"].shape[0] // batch))
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("chemtrain").setLevel(logging.WARNING)
    data, box, _, _ = lj_fluid_dataset(n_particles=64, n_frames=args.frames)
    disp, _ = space.periodic(box)
    nbrs = partition.neighbor_list(disp, box, 0.9, dr_threshold=0.05, capacity_multiplier=1.5,
                                   format=partition.NeighborListFormat.Sparse
                                   ).allocate(data["R"][0], extra_capacity=16)
    template = pair_mlp_template(disp, 0.9, n_basis=16, r_min=0.25)
    params = init_pair_mlp(jax.random.PRNGKey(0), hidden=(32, 32), n_basis=16)
    gammas = {"U": 1e-2, "F": 1.0}
    ours, ref = [], []
    for _ in range(args.repeats):  # alternate to share the machine's noise
        ref += hand_written(params, template, nbrs, data, args.batch, args.epochs, gammas)
        ours += chemtrain_steps(params, template, nbrs, data, args.batch, args.epochs, gammas)
    t_ours, t_ref = float(np.median(ours)), float(np.median(ref))
    print(f"device: {jax.devices()[0].platform}, batch {args.batch}, 64 atoms, "
          f"{len(ours)} epochs each of {args.frames // args.batch} steps")
    print(f"hand-written jitted optax step: {t_ref * 1e3:.2f} ms/step (median)")
    print(f"ForceMatching step:            {t_ours * 1e3:.2f} ms/step (median)")
    print(f"ratio ForceMatching / hand-written: {t_ours / t_ref:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()

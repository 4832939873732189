"""MACE training steps on the 370-atom nanotube: precomputed graphs against
the jax-md neighbor list, same model, same data, same order, side by side.

    .venv/bin/python benchmarks/graphs.py [--batch 2] [--steps 4] [--epochs 3]
        [--channels 32] [--max-ell 1] [--correlation 2] [--r-max 5.0]
        [--capacity-multiplier 1.1] [--float64]

Both trainers are ``ForceMatching`` on one device with the same random MACE
(MACE-MP's architecture at a chosen width) and the same frames (the nanotube
of ``benchmarks/mace_vs_torch.py`` with jittered positions). The
neighbor-list trainer updates a jax-md list (chosen by
``chemtrain.neighbors.neighbor_list``: free space, no cell list) for every
structure of every step, which under vmap is a full rebuild; the graph
trainer gets edges precomputed once on the host (``add_graphs``) and
``nbrs_init=None``. The list holds ``--capacity-multiplier`` times the
densest frame's pairs (it needs room for moving atoms); the graphs hold
exactly the densest frame's edges. The first epoch (compilation) is left
out; epochs then alternate between the two so that machine load hits both
alike. Prints median wall and CPU (process) time per step and their ratios
(graph / neighbor list), the cost of the list update alone, after checking
that both trainers predict the same energies and forces.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mace_vs_torch import nanotube  # noqa: E402

SILU_2MOM = 1.6791767923989418  # e3nn's second-moment normalisation of SiLU (mace-torch's)


def config(channels, max_ell, correlation, r_max, avg_num_neighbors):
    """A MACE-MP-like architecture (two residual blocks, scalar hidden features)."""
    from chemtrain.models import mace
    sh = "+".join(f"{channels}x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(max_ell + 1))
    hidden = f"{channels}x0e"
    layer = lambda readout: mace.Layer(  # noqa: E731
        interaction="RealAgnosticResidualInteractionBlock", node_irreps=hidden, edge_irreps=hidden,
        target_irreps=sh, hidden_irreps=hidden, correlation=correlation, readout=readout)
    return mace.MaceConfig(
        atomic_numbers=(1, 6), r_max=r_max, num_bessel=10, num_polynomial_cutoff=5, max_ell=max_ell,
        avg_num_neighbors=avg_num_neighbors, radial_mlp=(64, 64, 64),
        layers=(layer("linear"), layer("nonlinear")), mlp_irreps="16x0e",
        atomic_energies=(-13.6, -1030.0), scale=1.0, shift=0.0, act_constant=SILU_2MOM)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="structures per step")
    p.add_argument("--steps", type=int, default=4, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per trainer")
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--max-ell", type=int, default=1)
    p.add_argument("--correlation", type=int, default=2)
    p.add_argument("--r-max", type=float, default=5.0, help="Angstrom")
    p.add_argument("--capacity-multiplier", type=float, default=1.1,
                   help="jax-md list capacity over the densest frame's pair count (1.0: the "
                        "graphs' edge count)")
    p.add_argument("--float64", action="store_true")
    args = p.parse_args(argv)

    import jax
    if args.float64:
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import optax
    from chemtrain import neighbors as nb
    from chemtrain.models import mace
    from chemtrain.trainers import ForceMatching, RunOptions

    dtype = np.float64 if args.float64 else np.float32
    atoms = nanotube()
    n_frames = args.batch * args.steps
    rng = np.random.default_rng(0)
    R = (atoms.positions[None] + rng.normal(0, 0.02, (n_frames, len(atoms), 3))) * 0.1
    data = {"R": R.astype(dtype), "species": np.tile(atoms.numbers.astype(np.int32), (n_frames, 1)),
            "U": rng.normal(size=n_frames).astype(dtype),
            "F": rng.normal(size=R.shape).astype(dtype)}
    cutoff = args.r_max * 0.1
    t = time.perf_counter()
    graphs = nb.add_graphs(data, cutoff)
    t_graphs = time.perf_counter() - t
    per_frame = (graphs["senders"] < len(atoms)).sum(1)
    n_edges = int(per_frame.max())
    cfg = config(args.channels, args.max_ell, args.correlation, args.r_max,
                 avg_num_neighbors=n_edges / len(atoms))
    params = mace.init_params(cfg, jax.random.PRNGKey(0), dtype)

    displacement, _ = nb.make_space(None)
    nbrs = nb.neighbor_list(displacement, None, cutoff,
                            capacity_multiplier=args.capacity_multiplier).allocate(
        jnp.asarray(data["R"][int(np.argmax(per_frame))]))   # on the densest frame
    template = mace.energy_fn_template(cfg, displacement)
    tmp = tempfile.mkdtemp()
    kw = dict(batch=args.batch, parallelism="single", options=RunOptions(progress=False),
              checkpoint_path=tmp,
              gammas={"U": 1e-3, "F": 1.0})
    trainers = {"neighbor list": ForceMatching(params, optax.adam(1e-4), template, nbrs, **kw),
                "graph": ForceMatching(params, optax.adam(1e-4), template, None, **kw)}
    trainers["neighbor list"].set_dataset(data, "training")
    trainers["graph"].set_dataset(graphs, "training")
    pred = {k: tr.predict(graphs if k == "graph" else data) for k, tr in trainers.items()}
    agree = {t: float(np.abs(pred["graph"][t] - pred["neighbor list"][t]).max()
                      / np.abs(pred["neighbor list"][t]).max()) for t in ("U", "F")}

    compile_s, steps, cpu = {}, {k: [] for k in trainers}, {k: [] for k in trainers}
    for k, tr in trainers.items():
        t = time.perf_counter()
        tr.train(1)
        compile_s[k] = time.perf_counter() - t
    for _ in range(args.epochs):
        for k, tr in trainers.items():
            t, c = time.perf_counter(), time.process_time()
            tr.train(1)
            steps[k].append((time.perf_counter() - t) / args.steps)
            cpu[k].append((time.process_time() - c) / args.steps)
    med = {k: statistics.median(v) for k, v in steps.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    # what the neighbor-list trainer spends on the list alone: one batch's update under vmap
    rebuild = jax.jit(jax.vmap(lambda r: nbrs.update(r).idx))
    batch_R = jnp.asarray(data["R"][:args.batch])
    jax.block_until_ready(rebuild(batch_R))
    t_rebuild = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(rebuild(batch_R))
        t_rebuild.append(time.perf_counter() - t)

    print(f"nanotube {len(atoms)} atoms, {n_edges} edges (r_max {args.r_max} A), neighbor-list "
          f"capacity {nbrs.idx.shape[1]}, graph capacity {graphs['senders'].shape[1]}; MACE "
          f"{args.channels}x0e, max_ell {args.max_ell}, correlation {args.correlation}, "
          f"{np.dtype(dtype).name}; batch {args.batch}; jax {jax.__version__} on "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind}, {os.cpu_count()} CPUs)")
    print(f"graphs for {n_frames} frames built in {t_graphs:.2f} s on the host; initial "
          f"predictions agree: energies {agree['U']:.1e}, forces {agree['F']:.1e} (relative)")
    for k in trainers:
        print(f"{k:14s} step {1e3 * med[k]:9.1f} ms wall, {1e3 * med_cpu[k]:9.1f} ms CPU (median "
              f"of {args.epochs} epochs x {args.steps} steps; first epoch with compilation "
              f"{compile_s[k]:.1f} s)")
    print(f"neighbor-list update alone (vmapped over the batch, forward only): "
          f"{1e3 * statistics.median(t_rebuild):.1f} ms")
    print(f"ratio graph / neighbor list: {med['graph'] / med['neighbor list']:.3f} wall, "
          f"{med_cpu['graph'] / med_cpu['neighbor list']:.3f} CPU")


if __name__ == "__main__":
    sys.exit(main())

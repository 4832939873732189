"""The main job: fit a neural pair potential to a jax-md Lennard-Jones fluid.

    python -m chemtrain.demo [--epochs 30] [--frames 300] [--batch 16]

Samples an argon-like fluid (64 atoms, 120 K) with jax-md's Langevin
integrator, labels frames with the reference energy and forces, then trains a
small MLP pair potential with ``ForceMatching(parallelism="auto")``. Prints a
progress bar, per-epoch losses and the final test force MAE; writes metrics
(JSON lines), a checkpoint and a loss plot under ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--parallelism", default="auto")
    p.add_argument("--out", default="runs/demo")
    args = p.parse_args(argv)

    # chemtrain's lines at INFO; other libraries' INFO (jax's, matplotlib's
    # "generated new fontManager" on a fresh machine) stays out of the log
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("chemtrain").setLevel(logging.INFO)
    import jax
    import optax
    from jax_md import partition, space
    from tqdm.contrib.logging import logging_redirect_tqdm

    from chemtrain.models import init_pair_mlp, pair_mlp_template
    from chemtrain.simulate import lj_fluid_dataset
    from chemtrain.trainers import ForceMatching

    t0 = time.perf_counter()
    print(f"Sampling {args.frames} frames of a 64-atom Lennard-Jones fluid with jax-md ...")
    data, box, _, _ = lj_fluid_dataset(n_particles=64, n_frames=args.frames)
    print(f"  done in {time.perf_counter() - t0:.1f} s; box {box:.3f} nm, "
          f"U in [{data['U'].min():.1f}, {data['U'].max():.1f}] kJ/mol")

    r_cut = 0.9
    displacement, _ = space.periodic(box)
    neighbor_fn = partition.neighbor_list(displacement, box, r_cut, dr_threshold=0.05,
                                          capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    nbrs_init = neighbor_fn.allocate(data["R"][0], extra_capacity=16)
    template = pair_mlp_template(displacement, r_cut, n_basis=16, r_min=0.25)
    params = init_pair_mlp(jax.random.PRNGKey(0), hidden=(32, 32), n_basis=16)
    schedule = optax.cosine_decay_schedule(args.lr, args.epochs * args.frames // args.batch)
    os.makedirs(args.out, exist_ok=True)
    metrics_file = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    trainer = ForceMatching(params, optax.adam(schedule), template, nbrs_init, batch=args.batch,
                            parallelism=args.parallelism, gammas={"U": 1e-2, "F": 1.0},
                            checkpoint_path=os.path.join(args.out, "checkpoints"),
                            log_file=metrics_file)
    trainer.set_datasets(data, train_ratio=0.7, val_ratio=0.1, shuffle=True, seed=0)
    with logging_redirect_tqdm():
        trainer.train(args.epochs, checkpoint_freq=max(1, args.epochs // 3))
    test = trainer.evaluate("testing")
    f_scale = float(abs(data["F"]).mean())
    print(f"Test set ({test['n_structures']} structures): force MAE {test['F']['MAE']:.3f} kJ/mol/nm "
          f"(mean |F| {f_scale:.1f} kJ/mol/nm), force RMSE {test['F']['RMSE']:.3f} kJ/mol/nm, "
          f"energy MAE {test['U']['MAE']:.3f} kJ/mol")
    if trainer.strategy.is_root:
        try:
            plot_losses(trainer, os.path.join(args.out, "losses.png"))
            print(f"Loss curves: {os.path.join(args.out, 'losses.png')}")
        except ImportError:
            pass
    print(f"Metrics: {metrics_file}; total time {time.perf_counter() - t0:.1f} s")
    return 0


def plot_losses(trainer, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.semilogy(trainer.train_losses, label="training")
    if trainer.val_losses:
        ax.semilogy(trainer.val_losses, label="validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

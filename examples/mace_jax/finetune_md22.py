"""Fine-tune MACE on the MD22 double-walled nanotube (370 atoms) with chemtrain.

    python examples/mace_jax/finetune_md22.py                       # stand-in data, small random MACE
    python examples/mace_jax/finetune_md22.py --data md22_double-walled_nanotube.npz \\
        --foundation mace-mp-0-medium.model --trust-foundation --batch 8 --epochs 50 --train 800
    mpirun -np 2 python examples/mace_jax/finetune_md22.py --data nanotube.h5   # HDF5 from chemtrain-convert

Reads an MD22 ``.npz`` (``R`` Angstrom, ``E`` kcal/mol, ``F`` kcal/mol/Angstrom,
``z``; converted to nm and kJ/mol here) or an HDF5 file written by
``chemtrain-convert`` (already in nm and kJ/mol; training batches are read
from the file by each process for itself). Without ``--data`` it uses the
stand-in next to this script (see ``make_standin.py``: a classical AIREBO
MD, not MD22's DFT). Without ``--foundation`` it starts from a small randomly
initialised MACE with MACE-MP's architecture. It prints the test-set MAE and
RMSE before and after training (energies in eV/atom, forces in eV/Angstrom),
saves checkpoints under ``--out`` (continue with ``--resume``) and draws a
parity plot of the test predictions. The defaults (a small random model, 60
training structures, 5 epochs of global batch 2) take about 6 minutes on two
shared CPU cores.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(HERE, "nanotube_standin.npz")
KCAL, EV, NM = 4.184, 96.48533212, 0.1   # kJ/mol per kcal/mol, kJ/mol per eV, nm per Angstrom
SILU_2MOM = 1.6791767923989418  # e3nn's second-moment normalisation of SiLU, as in mace-torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", help="MD22 .npz or chemtrain HDF5 file (default: the stand-in)")
    p.add_argument("--foundation", help="mace-torch .model file (e.g. MACE-MP) or chemtrain MACE .npz")
    p.add_argument("--trust-foundation", action="store_true",
                   help="a .model file is a pickle that can run code: load it only from a source you trust")
    p.add_argument("--parallelism", default="auto", choices=["auto", "single", "jax", "mpi"])
    p.add_argument("--batch", type=int, default=2, help="structures per step, over all devices")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train", type=int, default=60, help="training structures")
    p.add_argument("--valid", type=int, default=10, help="validation structures")
    p.add_argument("--test", type=int, default=50, help="test structures")
    p.add_argument("--lr", type=float, default=None, help="default 1e-2 from scratch, 1e-3 fine-tuning")
    p.add_argument("--channels", type=int, default=8, help="random model: channels")
    p.add_argument("--max-ell", type=int, default=1, help="random model: L_max of the edge features")
    p.add_argument("--correlation", type=int, default=2, help="random model: body order - 1")
    p.add_argument("--r-max", type=float, default=4.0, help="random model: cutoff (Angstrom)")
    p.add_argument("--energy-weight", type=float, default=1e-3,
                   help="loss weight of energies (kJ/mol)^2 against forces (kJ/mol/nm)^2")
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument("--out", default="runs/md22", help="output folder (checkpoints, metrics, plot)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out (up to --epochs in all)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="epochs between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jax-cache", help="folder for JAX's persistent compilation cache (reused by "
                                       "later runs of the same model and shapes)")
    return p.parse_args(argv)


# -- data -----------------------------------------------------------------------
def read_npz(path):
    """An MD22/sGDML ``.npz`` in chemtrain units: R (nm), U (kJ/mol), F (kJ/mol/nm)."""
    f = np.load(path)
    n, atoms = f["R"].shape[:2]
    return {"R": f["R"] * NM, "U": f["E"].reshape(n) * KCAL, "F": f["F"] * (KCAL / NM),
            "species": np.broadcast_to(f["z"].astype(np.int32), (n, atoms)).copy()}


def read_rows(path, rows):
    """Rows of a chemtrain HDF5 file (already in nm and kJ/mol)."""
    import h5py
    order = np.argsort(rows)
    with h5py.File(path, "r") as f:
        data = {k: f[k][np.sort(rows)] for k in ("R", "U", "F", "species", "mask") if k in f}
    return {k: v[np.argsort(order)] for k, v in data.items()}


def n_structures(path):
    if path.endswith(".npz"):
        return len(np.load(path)["R"])
    import h5py
    with h5py.File(path, "r") as f:
        return len(f["R"])


def hdf5_training_loader(path, rows, dtype):
    """The HDF5 loader, restricted to the training rows of the file, handing
    out floating-point data in the training precision."""
    from chemtrain.data import HDF5ParallelDataLoader
    return HDF5ParallelDataLoader(path, rows=rows, dtype=dtype)


# -- model ----------------------------------------------------------------------
def mace_mp_config(atomic_numbers, channels, max_ell, correlation, r_max, avg_num_neighbors, scale):
    """MACE-MP's architecture (two residual interaction blocks, Bessel basis
    with polynomial cutoff, radial MLP [64, 64, 64], scalar hidden features,
    non-linear last readout) at a chosen width, angular resolution and body
    order; E0s are set later."""
    from chemtrain.models import mace
    sh = "+".join(f"{channels}x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(max_ell + 1))
    hidden = f"{channels}x0e"
    layer = lambda readout: mace.Layer(interaction="RealAgnosticResidualInteractionBlock",
                                       node_irreps=hidden, edge_irreps=hidden, target_irreps=sh,
                                       hidden_irreps=hidden, correlation=correlation, readout=readout)
    return mace.MaceConfig(
        atomic_numbers=tuple(atomic_numbers), r_max=r_max, num_bessel=10, num_polynomial_cutoff=5,
        max_ell=max_ell, avg_num_neighbors=avg_num_neighbors, radial_mlp=(64, 64, 64),
        layers=(layer("linear"), layer("nonlinear")), mlp_irreps="16x0e",
        atomic_energies=(0.0,) * len(atomic_numbers), scale=scale, shift=0.0, act_constant=SILU_2MOM)


def fit_e0(cfg, params, displacement, nbrs, data):
    """Per-element energies (eV) by least squares of the reference energies
    minus the model's interaction energies on a few training structures, as
    mace-torch estimates E0s for a new data set."""
    import dataclasses
    import jax
    from chemtrain.models import mace
    zero = dataclasses.replace(cfg, atomic_energies=(0.0,) * cfg.num_elements)
    energy_fn = mace.energy_fn_template(zero, displacement)(params)
    kwargs = {k: data[k] for k in ("species", "mask") if k in data}
    one = lambda R, kw: energy_fn(R, nbrs.update(R), **kw)
    inter = np.asarray(jax.jit(jax.vmap(one))(data["R"], kwargs))
    counts = np.stack([(data["species"] == z).sum(1) for z in cfg.atomic_numbers], 1).astype(float)
    e0, *_ = np.linalg.lstsq(counts, (data["U"] - inter) / EV, rcond=None)
    present = counts.sum(0) > 0   # elements absent from the data keep their E0s
    return dataclasses.replace(cfg, atomic_energies=tuple(
        float(new) if here else old for new, old, here in zip(e0, cfg.atomic_energies, present)))


def refit_e0(cfg, data, residual):
    """Add to the E0s the per-element least-squares fit of ``residual``
    (kJ/mol per structure); return the new config and ``data -> energy
    change (kJ/mol)`` of the structures in ``data``."""
    import dataclasses
    counts = lambda d: np.stack([(d["species"] == z).sum(1) for z in cfg.atomic_numbers], 1)
    delta, *_ = np.linalg.lstsq(counts(data).astype(float), residual / EV, rcond=None)
    new = dataclasses.replace(cfg, atomic_energies=tuple(
        float(a + b) for a, b in zip(cfg.atomic_energies, delta)))
    return new, lambda d: counts(d) @ delta * EV


# -- metrics and plot ------------------------------------------------------------
def errors(pred, ref):
    """Energy errors per atom (eV/atom) and force-component errors (eV/Angstrom)."""
    mask = ref.get("mask", np.ones(ref["R"].shape[:2], bool))
    e = (pred["U"] - ref["U"]) / EV / mask.sum(1)
    f = ((pred["F"] - ref["F"]) * (NM / EV))[mask]
    return e, f.ravel()


def summary(pred, ref):
    e, f = errors(pred, ref)
    mae_rmse = lambda x: (float(np.abs(x).mean()), float(np.sqrt((x ** 2).mean())))
    return {"energy_eV_per_atom": dict(zip(("MAE", "RMSE"), mae_rmse(e))),
            "force_eV_per_A": dict(zip(("MAE", "RMSE"), mae_rmse(f)))}


def parity_plot(path, ref, curves):
    """Energies (eV/atom) and force components (eV/A): prediction against
    reference, one colour per model, with MAE and RMSE in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mask = ref.get("mask", np.ones(ref["R"].shape[:2], bool))
    refs = {"energy_eV_per_atom": ref["U"] / EV / mask.sum(1),
            "force_eV_per_A": (ref["F"] * (NM / EV))[mask].ravel()}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for (label, pred), colour in zip(curves.items(), ("#aaaaaa", "#1f77b4")):
        s = summary(pred, ref)
        for ax, (key, x), d in zip(axes, refs.items(), errors(pred, ref)):
            unit = "eV/atom" if key.startswith("energy") else "eV/Å"
            ax.scatter(x, x + d, s=6 if key.startswith("energy") else 1, alpha=0.6, color=colour,
                       label=f"{label}: MAE {s[key]['MAE']:.4f}, RMSE {s[key]['RMSE']:.4f} {unit}")
    for ax, (key, x), title in zip(axes, refs.items(), ("energy (eV/atom)", "force components (eV/Å)")):
        lo, hi = ax.get_ylim()
        lo, hi = min(lo, x.min()), max(hi, x.max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"reference {title}")
        ax.set_ylabel(f"predicted {title}")
        ax.legend(loc="upper left", fontsize=8, markerscale=4)
    fig.suptitle(f"test set: {len(refs['energy_eV_per_atom'])} structures")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the job ----------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    if args.float64:
        jax.config.update("jax_enable_x64", True)
    if args.jax_cache:
        jax.config.update("jax_compilation_cache_dir", args.jax_cache)
    import jax.numpy as jnp
    import optax
    from jax_md import partition, space
    from tqdm.contrib.logging import logging_redirect_tqdm
    from chemtrain.models import mace
    from chemtrain.parallel import resolve
    from chemtrain.trainers import ForceMatching
    dtype = np.float64 if args.float64 else np.float32
    notes = []  # printed by the root process once the trainer knows who that is

    # data: a fixed random split of the structures; the training rows of an
    # HDF5 file stay on disk, the (small) validation and test sets are read
    path = args.data or STANDIN
    if not args.data:
        notes.append(f"No --data: using the stand-in {os.path.relpath(path)} (AIREBO energies and "
                     f"forces from a 400 K MD; not MD22's PBE+MBD data, see make_standin.py).")
    if not os.path.exists(path):
        raise SystemExit(f"--data {path} does not exist; give an MD22 .npz or an HDF5 file from "
                         f"chemtrain-convert.")
    ckpt_dir = os.path.join(args.out, "checkpoints")
    earlier = sorted(glob.glob(os.path.join(ckpt_dir, "epoch_*.npz")))
    if earlier and not args.resume:
        raise SystemExit(f"{ckpt_dir} holds checkpoints of an earlier run ({os.path.basename(earlier[-1])}); "
                         f"pass --resume to continue it, or choose another --out.")
    if args.resume and not earlier:
        raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}; run without --resume first.")
    total = n_structures(path)
    need = args.train + args.valid + args.test
    if need > total:
        raise SystemExit(f"--train {args.train} + --valid {args.valid} + --test {args.test} = {need} "
                         f"structures, but {path} holds {total}; ask for fewer.")
    order = np.random.default_rng(args.seed).permutation(total)
    rows = {"training": order[:args.train], "validation": order[args.train:args.train + args.valid],
            "testing": order[args.train + args.valid:need]}
    hdf5 = not path.endswith(".npz")
    if hdf5:  # training batches are read from the file during training
        sets = {stage: read_rows(path, r[:32] if stage == "training" else r) for stage, r in rows.items()}
    else:
        everything = read_npz(path)
        sets = {stage: {k: v[r] for k, v in everything.items()} for stage, r in rows.items()}
    sets = {stage: {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in d.items()}
            for stage, d in sets.items()}
    train = sets["training"]  # all of it (npz) or its first 32 structures (HDF5)
    n_atoms = train["R"].shape[1]

    # neighbor list: open boundaries, allocated on the (sampled) training
    # structure with the most pairs, with 10 % room
    if args.foundation:
        cfg, params = (mace.load(args.foundation) if args.foundation.endswith(".npz") else
                       mace.load_mace_torch(args.foundation, trusted=args.trust_foundation))
        notes.append(f"Fine-tuning {args.foundation}: {len(jax.tree.leaves(params))} weight arrays, "
                     f"r_max {cfg.r_max} A; E0s refitted to this data set.")
    r_max = cfg.r_max if args.foundation else args.r_max
    displacement, _ = space.free()
    d = np.linalg.norm(train["R"][:, :, None] - train["R"][:, None], axis=-1)
    pairs = ((d < r_max * NM) & (d > 0)).sum((1, 2))
    neighbor_fn = partition.neighbor_list(displacement, 100.0, r_max * NM, dr_threshold=0.0,
                                          capacity_multiplier=1.1, format=partition.Sparse,
                                          disable_cell_list=True)
    nbrs = neighbor_fn.allocate(jnp.asarray(train["R"][int(np.argmax(pairs))]))
    if not args.foundation:
        rms_force = float(np.sqrt(np.mean(train["F"] ** 2))) * NM / EV
        cfg = mace_mp_config([int(z) for z in np.unique(train["species"]) if z > 0], args.channels,
                             args.max_ell, args.correlation, r_max,
                             avg_num_neighbors=float(pairs.mean()) / n_atoms, scale=rms_force)
        params = mace.init_params(cfg, jax.random.PRNGKey(args.seed), dtype)
        notes.append(f"No --foundation: starting from a randomly initialised MACE with MACE-MP's "
                     f"architecture ({args.channels} channels, L_max {args.max_ell}, correlation "
                     f"{args.correlation}, r_max {r_max} A, {sum(p.size for p in jax.tree.leaves(params))} "
                     f"parameters).")
    params = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
    cfg = fit_e0(cfg, params, displacement, nbrs, {k: jnp.asarray(v[:8]) for k, v in train.items()})

    # the trainer: mostly forces (the E0s absorb the energy zero, see refit_e0)
    lr = args.lr or (1e-3 if args.foundation else 1e-2)
    steps = args.epochs * (args.train // args.batch)
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1), alpha=0.05))
    os.makedirs(args.out, exist_ok=True)
    trainer = ForceMatching(params, optimizer, mace.energy_fn_template(cfg, displacement), nbrs,
                            batch=args.batch, parallelism=args.parallelism,
                            gammas={"U": args.energy_weight, "F": 1.0},
                            checkpoint_path=ckpt_dir,
                            log_file=os.path.join(args.out, "metrics.jsonl"), seed=args.seed)
    root = trainer.strategy.is_root
    say = print if root else (lambda *a, **k: None)
    for note in notes:
        say(note)
    say(f"{os.path.basename(path)}: {total} structures of {n_atoms} atoms; training on {args.train}, "
        f"validating on {args.valid}, testing on {args.test}; parallelism {args.parallelism!r} -> "
        f"{resolve(args.parallelism)}, {trainer.strategy.n_shards} shard(s), global batch {args.batch}, "
        f"{'float64' if args.float64 else 'float32'}")
    if hdf5:
        trainer.set_loader(hdf5_training_loader(path, rows["training"], dtype), "training")
    else:
        trainer.set_dataset(train, "training")
    if args.valid:
        trainer.set_dataset(sets["validation"], "validation")
    if args.resume:
        trainer.restore(earlier[-1])
        say(f"Resumed from {earlier[-1]} (epoch {trainer.epoch})")

    # E0s are constants of the model, not trained: before reporting, refit
    # them to what the model leaves over on (up to 32) training structures
    sample = sets["training"] if hdf5 else {k: v[:32] for k, v in train.items()}
    test = sets["testing"]

    def test_predictions(cfg):
        residual = sample["U"] - trainer.predict(sample)["U"]
        cfg, shift = refit_e0(cfg, sample, residual)
        pred = trainer.predict(test)
        return cfg, dict(pred, U=pred["U"] + shift(test))

    _, before = test_predictions(cfg)
    start = summary(before, test)
    label = "starting model" if not args.resume else f"restored model (epoch {trainer.epoch})"
    report = lambda name, s: say(
        f"Test MAE, {name}: energy {s['energy_eV_per_atom']['MAE']:.5f} eV/atom "
        f"(RMSE {s['energy_eV_per_atom']['RMSE']:.5f}), forces {s['force_eV_per_A']['MAE']:.4f} eV/A "
        f"(RMSE {s['force_eV_per_A']['RMSE']:.4f})")
    report(label, start)

    with logging_redirect_tqdm():
        trainer.train(max(args.epochs - trainer.epoch, 0), checkpoint_freq=args.checkpoint_every)
    if trainer.epoch % args.checkpoint_every:
        trainer.save_checkpoint(os.path.join(ckpt_dir, f"epoch_{trainer.epoch:05d}.npz"))

    cfg, after = test_predictions(cfg)
    final = summary(after, test)
    report(f"fine-tuned (epoch {trainer.epoch})", final)
    if root:
        plot = os.path.join(args.out, "parity.png")
        parity_plot(plot, test, {label: before, f"fine-tuned, epoch {trainer.epoch}": after})
        mace.save(os.path.join(args.out, "model.npz"), cfg, trainer.params)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"before": start, "after": final, "epoch": trainer.epoch,
                       "n_test": len(test["R"]), "test_rows": rows["testing"].tolist(),
                       "parallelism": trainer.strategy.name,
                       "n_shards": trainer.strategy.n_shards, "data": path}, f, indent=1)
        say(f"Parity plot: {plot}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("jax").setLevel(logging.WARNING)
    sys.exit(main())

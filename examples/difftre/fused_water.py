"""Fused training on a tetrahedral liquid: one MACE potential learns from
imperfect force labels and from structural targets together.

    python examples/difftre/fused_water.py [--epochs 20] [--out fused_water] [--seed 0]
        [--difftre-lr 5e-3] [--difftre-updates 1]

The system: 216 water beads at 33.4 nm^-3 (1.0 g/cm^3) and 298 K, Langevin
dynamics with dt 5 fs, float32.

1. **Targets ("experiment").** The mW model of water (Molinero and Moore,
   J. Phys. Chem. B 113, 4008 (2009)): a Stillinger-Weber potential with
   sigma 0.23925 nm, epsilon 6.189 kcal/mol, lambda 23.15, through jax-md's
   ``stillinger_weber_neighbor_list``. Its O-O RDF, its ADF (neighbors within
   0.32 nm) and its pressure, averaged over 200 snapshots.
2. **Imperfect reference data ("DFT").** The same potential with a weaker
   three-body term (lambda 20): a stand-in for a functional whose tetrahedral
   order is off. 200 frames of its own simulation, labelled with its forces;
   160 train, 40 test.
3. **Four trainings under one budget** (``--epochs`` E, ``--difftre-updates``
   K): an 8-channel MACE (L_max 1, correlation 2, r_max 4.5 A, one
   interaction) plus a repulsive prior (``sum_templates``; the prior's parameters frozen through the
   optimizer with ``freeze``), from the same initial parameters:
   - force matching alone: E epochs on the labels (Adam, step 1e-2 decaying
     to 1e-3);
   - DiffTRe alone: E x K updates on RDF, ADF and pressure (Adam,
     ``--difftre-lr``);
   - fused (``InterleaveTrainers``): E x (one force-matching epoch, then K
     DiffTRe updates) on one parameter set;
   - a pair-MLP potential plus the same prior under DiffTRe alone (2 x E x K
     updates of Adam 2e-2: cheap, so trained until it levels off): with
     pair terms alone the ADF is bought with the RDF.
4. **Comparison.** Every trained model is simulated afresh (5 ps + 10 ps, 100
   snapshots); the table gives RDF and ADF mean squared errors against the
   targets, the pressure, and the force RMSE on the 40 test frames of the
   imperfect labels.

Writes under ``--out``: ``results.json`` and ``results.md`` (the table),
``comparison.png`` (RDF, ADF and force error of every model), each
trainer's JSON-lines metrics and the fused run's checkpoints and plot.
13 minutes on two CPU cores with the defaults.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
import warnings

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import energy, simulate, space

from chemtrain import quantity
from chemtrain.finetune.model import random_config
from chemtrain.learn.reweighting import make_snapshot_evaluator
from chemtrain.models import freeze, mace, repulsive_template, sum_templates
from chemtrain.models.pair import init_pair_mlp, pair_mlp_template
from chemtrain.neighbors import neighbor_list
from chemtrain.simulate import make_trajectory, process_printouts, run_with_restart
from chemtrain.simulate.langevin import label_frames
from chemtrain.trainers import DifftreParallel, ForceMatching, InterleaveTrainers, RunOptions
from chemtrain.units import kT as kT_of

N, DENSITY, TEMPERATURE, MASS, DT = 216, 33.4, 298.0, 18.015, 0.005
BOX = (N / DENSITY) ** (1 / 3)
MW = dict(sigma=0.23925, epsilon=6.189 * 4.184, A=7.049556277, B=0.6022245584, gamma=1.2)
LAMBDA_TRUE, LAMBDA_LABELS = 23.15, 20.0
SW_CUTOFF = 1.8 * MW["sigma"]           # a sigma, 0.4307 nm
R_MAX = 0.45                            # nm, the models' cutoff
BAR = 16.6054                           # bar per kJ/mol/nm^3
PAIR_LR = 2e-2                          # the pair MLP's DiffTRe step
KT = kT_of(TEMPERATURE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=20, help="the budget E of every training")
    p.add_argument("--difftre-lr", type=float, default=5e-3, help="Adam step of every DiffTRe")
    p.add_argument("--difftre-updates", type=int, default=1,
                   help="K, DiffTRe updates per fused epoch (DiffTRe alone: E x K updates)")
    p.add_argument("--out", default="fused_water")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def system():
    displacement, shift = space.periodic(BOX)
    rdf_bins = quantity.rdf_discretization(0.6, 80, 0.2)
    adf_bins = quantity.adf_discretization(0.32, 60)
    quantities = {"rdf": quantity.rdf(displacement, rdf_bins, box=BOX),
                  "adf": quantity.adf(displacement, adf_bins, box=BOX, max_neighbors=12),
                  "pressure": quantity.pressure(box=BOX)}
    simulator = functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=DT, kT=KT, gamma=5.0)
    per = round(N ** (1 / 3))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return dict(displacement=displacement, quantities=quantities, simulator=simulator,
                rdf_bins=rdf_bins, adf_bins=adf_bins, lattice=(grid + 0.5) * BOX / per,
                neighbor_fn=neighbor_list(displacement, BOX, R_MAX, dr_threshold=0.03,
                                          capacity_multiplier=1.5),
                state_kwargs={"kT": KT, "mass": MASS, "species": np.full(N, 8)})


def mw_template(s, lam):
    """``params -> energy_fn`` of mW with three-body strength ``lam`` (no
    trainable parameters) and its Dense neighbor list."""
    _, sw = energy.stillinger_weber_neighbor_list(s["displacement"], BOX, lam=lam,
                                                  cutoff=SW_CUTOFF, **MW)

    def energy_fn(R, neighbor, perturbation=None, **kwargs):   # kT, mass, species: unused
        return sw(R, neighbor, **({} if perturbation is None else {"perturbation": perturbation}))
    nbr_fn = neighbor_list(s["displacement"], BOX, SW_CUTOFF, format="dense", dr_threshold=0.03,
                           capacity_multiplier=1.5)
    return (lambda params: energy_fn), nbr_fn


def simulate_and_measure(s, template, params, neighbor_fn, R0, key, timings):
    """(snapshot positions, mean RDF, ADF and pressure) of one trajectory."""
    init, run = make_trajectory(s["simulator"], template, neighbor_fn, timings)
    kw = s["state_kwargs"]
    traj = run_with_restart(run, neighbor_fn, params, init(params, key, jnp.asarray(R0), **kw),
                            jax.random.fold_in(key, 1), **kw)
    _, q, _ = jax.jit(make_snapshot_evaluator(template, s["quantities"], 10))(
        params, [(traj.snapshots, traj.nbrs)], kw)
    return (np.asarray(traj.snapshots.position),
            {k: np.asarray(v).mean(0) for k, v in q.items()})


def reference(s, seed):
    """Targets of mW (lambda 23.15) and force labels of lambda 20 on frames
    of its own simulation. Each: 20 ps equilibration, 200 snapshots 0.1 ps
    apart."""
    timings = process_printouts(DT, 40.0, 20.0, 0.1)
    out = {}
    for name, lam in (("true", LAMBDA_TRUE), ("labels", LAMBDA_LABELS)):
        template, nbr_fn = mw_template(s, lam)
        frames, q = simulate_and_measure(s, template, None, nbr_fn, s["lattice"],
                                         jax.random.PRNGKey(100 * seed + int(lam)), timings)
        out[name] = dict(frames=frames, **q)
    template, nbr_fn = mw_template(s, LAMBDA_LABELS)
    out["labels"].update(label_frames(template(None), nbr_fn, out["labels"]["frames"]))
    template, nbr_fn = mw_template(s, LAMBDA_TRUE)   # the true forces, for comparison only
    out["labels"]["F_true"] = label_frames(template(None), nbr_fn, out["labels"]["frames"])["F"]
    return out


def mace_model(s, seed):
    cfg = random_config((8,), avg_num_neighbors=13.0, scale=0.1, num_channels=8, max_L=1,
                        max_ell=2, correlation=2, r_max=10 * R_MAX, num_interactions=1,
                        radial_MLP=(16, 16))
    return ("mace", mace.energy_fn_template(cfg, s["displacement"]),
            mace.init_params(cfg, jax.random.PRNGKey(seed), jnp.float32))


def pair_model(s, seed):
    return ("pair", pair_mlp_template(s["displacement"], R_MAX),
            init_pair_mlp(jax.random.PRNGKey(seed), (32, 32)))


def with_prior(s, model):
    """MACE or pair MLP plus a repulsive prior (frozen in training)."""
    name, template, params = model
    prior = repulsive_template(s["displacement"], R_MAX, 0.40)
    return (sum_templates({"prior": prior, name: template}),
            {"prior": {"sigma": jnp.float32(0.25), "epsilon": jnp.float32(1.0)}, name: params})


def fm_trainer(s, template, params, data, folder, epochs, progress):
    steps = epochs * len(data["train"]["R"]) // 4
    optimizer = freeze(optax.adam(optax.exponential_decay(1e-2, steps, 0.1)), params, ["prior"])
    # one list for every frame (its capacity_multiplier 1.5 leaves room; extra
    # capacity of a Sparse list counts per atom, and every unused edge costs)
    nbrs = s["neighbor_fn"].allocate(jnp.asarray(data["train"]["R"][0]))
    tr = ForceMatching(params, optimizer, template, nbrs, batch=4, gammas={"F": 1.0},
                       checkpoint_path=folder, log_file=os.path.join(folder, "metrics.jsonl"),
                       options=RunOptions(progress=progress))
    tr.set_dataset(data["train"], "training")
    tr.set_dataset(data["test"], "testing")
    return tr


def difftre_trainer(s, template, params, targets, start, folder, seed, learning_rate, progress):
    optimizer = freeze(optax.adam(learning_rate), params, ["prior"])
    # species only for MACE: the trainer refuses state_kwargs that nothing reads
    kw = {k: np.asarray(v)[None] for k, v in s["state_kwargs"].items()
          if k != "species" or "mace" in params}
    tr = DifftreParallel(
        jax.random.PRNGKey(seed), params, optimizer, template, s["simulator"], s["neighbor_fn"],
        process_printouts(DT, 7.0, 2.0, 0.05), kw, s["quantities"],
        {"rdf": {"target": targets["rdf"][None], "gamma": 1.0},
         "adf": {"target": targets["adf"][None], "gamma": 30.0},
         "pressure": {"target": np.array([targets["pressure"]]), "gamma": 1e-7}},
        reference_states=start[None], reweight_ratio=0.9, vmap_batch=10,
        checkpoint_path=folder, options=RunOptions(
            log_file=os.path.join(folder, "metrics.jsonl"), progress=progress,
            plot_x={"rdf": np.asarray(s["rdf_bins"].bin_centers),
                    "adf": np.degrees(np.asarray(s["adf_bins"].bin_centers))}))
    return tr



def force_rmse(s, template, params, frames, forces):
    """RMSE (kJ/mol/nm) of the model's forces against ``forces`` on ``frames``."""
    energy_fn, species = template(params), jnp.asarray(s["state_kwargs"]["species"])
    F = label_frames(lambda R, neighbor: energy_fn(R, neighbor, species=species),
                     s["neighbor_fn"], frames)["F"]
    return float(np.sqrt(np.mean((F - forces) ** 2)))


def measure(s, template, params, targets, start, test, seed):
    """RDF/ADF MSE against the targets and the pressure of a fresh 15 ps
    simulation (5 ps equilibration, 100 snapshots), and the force RMSE on the
    test frames of the imperfect labels."""
    _, q = simulate_and_measure(s, template, params, s["neighbor_fn"], start,
                                jax.random.PRNGKey(7000 + seed), process_printouts(DT, 15.0, 5.0, 0.1))
    return row(q, targets, force_rmse(s, template, params, test["R"], test["F"]))


def row(q, targets, rmse):
    return {"rdf_mse": float(np.mean((q["rdf"] - targets["rdf"]) ** 2)),
            "adf_mse": float(np.mean((q["adf"] - targets["adf"]) ** 2)),
            "pressure_bar": float(q["pressure"]) * BAR, "force_rmse": rmse,
            "rdf": q["rdf"].tolist(), "adf": q["adf"].tolist()}


def table(rows) -> str:
    lines = ["| model | training | RDF MSE | ADF MSE (rad^-2) | pressure (bar) | force RMSE on "
             "imperfect labels (kJ/mol/nm) | time (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        model, _, how = name.partition(": ")
        t = f"{r['seconds']:.0f}" if "seconds" in r else ""
        lines.append(f"| {model} | {how} | {r['rdf_mse']:.2e} | {r['adf_mse']:.2e} | "
                     f"{r['pressure_bar']:.0f} | {r['force_rmse']:.1f} | {t} |")
    return "\n".join(lines)


def plot(s, rows, targets, path):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(13, 3.8), constrained_layout=True)
    ax_rdf, ax_adf, ax_bar = fig.subplots(1, 3)
    r_nm = np.asarray(s["rdf_bins"].bin_centers)
    deg = np.degrees(np.asarray(s["adf_bins"].bin_centers))
    ax_rdf.plot(r_nm, targets["rdf"], "k--", lw=2, label="target (mW)")
    ax_adf.plot(deg, targets["adf"], "k--", lw=2, label="target (mW)")
    trained = [n for n in rows if not n.startswith("mW")]
    for i, name in enumerate([n for n in rows if "lambda 20" in n] + trained):
        style = dict(color=f"C{i}", label=name.replace(": ", ", "))
        ax_rdf.plot(r_nm, rows[name]["rdf"], **style)
        ax_adf.plot(deg, rows[name]["adf"], **style)
    ax_rdf.set(xlabel="r (nm)", ylabel="g(r)", title="O-O RDF")
    ax_adf.set(xlabel="angle (degrees)", ylabel="density (rad$^{-1}$)", title="ADF, r < 0.32 nm")
    ax_adf.legend(fontsize=7)
    x = np.arange(len(trained))
    ax_bar.bar(x - 0.2, [rows[n]["adf_mse"] * 1e3 for n in trained], 0.4, label="ADF MSE x 1e3")
    ax_bar.bar(x + 0.2, [rows[n]["force_rmse"] / 10 for n in trained], 0.4,
               label="force RMSE / 10 (kJ/mol/nm)")
    ax_bar.set_xticks(x, [n.replace(": ", "\n") for n in trained], fontsize=7)
    ax_bar.set_yscale("log")
    ax_bar.legend(fontsize=7)
    ax_bar.set_title("structure against forces")
    fig.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")  # jax-md's SW
    if os.path.isdir(args.out) and os.listdir(args.out):
        raise SystemExit(f"{args.out} already holds a run (metrics files and checkpoints, which "
                         f"this one would not overwrite): pass another --out or remove it.")
    os.makedirs(args.out, exist_ok=True)
    E, K, lr = args.epochs, args.difftre_updates, args.difftre_lr
    seed, started = args.seed, time.perf_counter()
    s = system()
    ref = reference(s, seed)
    targets, labels = ref["true"], ref["labels"]
    frames = {k: labels[k] for k in ("R", "F")}
    frames["species"] = np.full((len(frames["R"]), N), 8)
    data = {"train": {k: v[:160] for k, v in frames.items()},
            "test": {k: v[160:] for k, v in frames.items()}}
    start, test = targets["frames"][-1], data["test"]
    rows = {"mW lambda 23.15: the targets": row(targets, targets, float(np.sqrt(np.mean(
                (labels["F_true"][160:] - test["F"]) ** 2)))),
            "mW lambda 20: the labels' reference": row(labels, targets, 0.0)}
    print(f"reference data ({time.perf_counter() - started:.0f} s): pressure "
          f"{targets['pressure'] * BAR:.0f} bar (lambda 23.15), "
          f"{labels['pressure'] * BAR:.0f} bar (lambda 20)", flush=True)
    template, init = with_prior(s, mace_model(s, seed))
    progress = False

    def timed(name, trainers, train, tpl=template):
        t = time.perf_counter()
        train()
        seconds = time.perf_counter() - t
        rows[name] = dict(measure(s, tpl, trainers.params, targets, start, test, seed),
                          seconds=seconds)
        print(f"{name}: ADF MSE {rows[name]['adf_mse']:.2e}, force RMSE "
              f"{rows[name]['force_rmse']:.1f} ({seconds:.0f} s)", flush=True)

    out = functools.partial(os.path.join, args.out)
    fm = fm_trainer(s, template, init, data, out("fm"), E, progress)
    timed("MACE + prior: force matching", fm, lambda: fm.train(E))

    dt = difftre_trainer(s, template, init, targets, start, out("difftre"), seed, lr, progress)
    timed("MACE + prior: DiffTRe", dt, lambda: (dt.initialize_trajstates(), dt.train(E * K)))

    fused = InterleaveTrainers(out("fused"), options=RunOptions(
        log_file=out("fused", "metrics.jsonl"), plot_file=out("fused", "losses.png"),
        progress=progress))
    fused.add_trainer(fm_trainer(s, template, init, data, out("fused", "fm"), E, progress),
                      num_updates=1, name="FM")
    dt_fused = difftre_trainer(s, template, init, targets, start, out("fused", "difftre"), seed,
                               lr, progress)
    fused.add_trainer(dt_fused, num_updates=K, name="DiffTRe")
    timed("MACE + prior: fused", dt_fused,
          lambda: (dt_fused.initialize_trajstates(), fused.train(E)))

    pair_template, pair_init = with_prior(s, pair_model(s, seed))
    # cheap per update: twice the updates and a larger step, to show where it levels off
    pair = difftre_trainer(s, pair_template, pair_init, targets, start, out("pair"), seed,
                           PAIR_LR, progress)
    timed("pair MLP + prior: DiffTRe", pair,
          lambda: (pair.initialize_trajstates(), pair.train(2 * E * K)), pair_template)

    text = table(rows)
    print(text)
    with open(out("results.md"), "w") as f:
        f.write(f"`python examples/difftre/fused_water.py --epochs {E} --seed {seed} "
                f"--difftre-lr {lr:g} --difftre-updates {K}`, "
                f"{time.perf_counter() - started:.0f} s in all\n\n{text}\n")
    with open(out("results.json"), "w") as f:
        json.dump({"epochs": E, "difftre_lr": lr, "difftre_updates": K, "seed": seed,
                   "rows": rows}, f)
    plot(s, rows, targets, out("comparison.png"))
    fm_adf, fused_adf = rows["MACE + prior: force matching"], rows["MACE + prior: fused"]
    print(f"fused against force matching alone: ADF MSE / "
          f"{fm_adf['adf_mse'] / fused_adf['adf_mse']:.2f}, force RMSE x "
          f"{fused_adf['force_rmse'] / fm_adf['force_rmse']:.2f}; "
          f"{time.perf_counter() - started:.0f} s in all; plot: {out('comparison.png')}")


if __name__ == "__main__":
    main()

"""Structure and dynamics together: a MACE potential of water beads learns the
self-diffusion coefficient of its "experiment" while keeping its structure.

    python examples/difftre/water_diffusion.py [--updates 20] [--segments 20]
        [--segment-ps 1.0] [--backprop-ps 0.25] [--lr 5e-3] [--d-weight 1e6] [--check-segments 200]
        [--out water_diffusion] [--seed 0]
    python examples/difftre/water_diffusion.py --plot-from RUN/results.json --out DIR

The state point, targets and model are those of ``fused_water.py`` (216
beads at 1.0 g/cm^3 and 298 K, dt 5 fs, float32): the "experiment" is the mW
model of water (lambda 23.15), here with one more measured number, its
self-diffusion coefficient D (Green-Kubo over NVE segments, below). The
model is the 8-channel MACE plus a frozen repulsive prior.

1. **Start.** The MACE is force-matched on the imperfect labels (mW with
   lambda 20, 160 frames, 20 epochs), as in ``fused_water.py``: its
   structure and its dynamics are both off.
2. **Structure only** (DiffTRe): ``--updates`` updates of Adam ``--lr`` on
   the RDF, ADF and pressure, one trajectory per update (100 snapshots).
3. **Structure and D** (the dynamics objective, ``chemtrain.learn.
   dynamics_objective``): the same targets plus D, from the same start and
   with the same optimizer. Each update reweights ``--segments`` snapshots
   of one trajectory (0.25 ps apart) to the current parameters, runs an NVE
   segment of ``--segment-ps`` from each (velocity Verlet, the snapshot's
   momenta) and differentiates the loss through the start states' weights
   and the segments, the latter truncated to windows of ``--backprop-ps``
   (``make_segment(..., backprop_steps)``): through a whole 1-ps segment
   the exact gradient of this liquid is mostly noise
   (``benchmarks/dynamics_gradient_coherence.py``).
4. **Fresh checks**, independent of the trainers: each model (and the mW
   reference) is simulated afresh with jax-md alone. Structure: 5 ps + 10 ps
   of Langevin dynamics, 100 snapshots (``fused_water.measure``). D:
   ``--check-segments`` start states 0.1 ps apart from another Langevin run,
   new Maxwell-Boltzmann momenta for each, an NVE segment of jax-md's
   ``simulate.nve`` and D = 1/3 of numpy's trapezoid of the atom-averaged
   v(0).v(t); its standard error from 10 blocks of consecutive start states.

Writes under ``--out``: ``results.json`` and ``results.md`` (the table:
RDF and ADF errors, pressure, D and its error, time), ``water_diffusion.png``
(the ADFs and the velocity autocorrelation of the target and of each
model, and the dynamics trainer's D per update) and each trainer's metrics;
``--plot-from`` draws the figure again from ``results.json``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
import warnings

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import simulate, space

import fused_water as fw
from chemtrain.learn import ReuseRule, dynamics, dynamics_objective, simulation_functions
from chemtrain.learn.dynamics import check_steps
from chemtrain.models import freeze
from chemtrain.simulate import make_trajectory, process_printouts, run_with_restart
from chemtrain.trainers import Reweighting, RunOptions

SNAPSHOT_PS = 0.25   # start states of the dynamics objective, this far apart


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--updates", type=int, default=20, help="updates of each trainer")
    p.add_argument("--segments", type=int, default=20, help="start states per update")
    p.add_argument("--segment-ps", type=float, default=1.0, help="NVE segment length")
    p.add_argument("--backprop-ps", type=float, default=0.25,
                   help="truncated backpropagation: the gradient through a segment follows "
                        "the dynamics back at most this far (0: the exact gradient)")
    p.add_argument("--lr", type=float, default=5e-3,
                   help="Adam's first step in both trainers, cosine-decayed to 10 %% at the last")
    p.add_argument("--d-weight", type=float, default=1e6,
                   help="gamma of D's squared error (nm^4/ps^2)")
    p.add_argument("--d-scale", type=float, default=1.0,
                   help="the D target as a multiple of mW's (e.g. 0.85: a liquid of mW's "
                        "structure that diffuses 15 %% slower)")
    p.add_argument("--check-segments", type=int, default=200)
    p.add_argument("--fm-epochs", type=int, default=20)
    p.add_argument("--out", default="water_diffusion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-from", metavar="RESULTS_JSON",
                   help="only draw the figure again from a run's results.json, into --out")
    return p.parse_args(argv)


def vacf_check(s, template, params, neighbor_fn, start, n_segments, segment_ps, seed):
    """jax-md alone: (D per start state in nm^2/ps, mean VACF in nm^2/ps^2).

    Langevin NVT (5 ps, then a start state every 0.1 ps), new
    Maxwell-Boltzmann momenta for each, an NVE segment of ``segment_ps``
    whose atom-averaged v(0).v(t) integrates (numpy's trapezoid) to 3 D."""
    species = s["state_kwargs"].get("species")
    energy_fn = template(params)
    init, run = make_trajectory(s["simulator"], template, neighbor_fn,
                                process_printouts(fw.DT, 5.0 + 0.1 * n_segments, 5.0, 0.1))
    key = jax.random.PRNGKey(9000 + seed)
    traj = run_with_restart(run, neighbor_fn, params,
                            init(params, key, jnp.asarray(start), **s["state_kwargs"]),
                            jax.random.fold_in(key, 1), **s["state_kwargs"])
    starts = traj.snapshots.position
    P = jnp.sqrt(fw.MASS * fw.KT) * jax.random.normal(jax.random.fold_in(key, 2), starts.shape)
    steps = check_steps(fw.DT, segment_ps)
    nbrs0 = neighbor_fn.allocate(starts[0], extra_capacity=8)

    shift = space.periodic(fw.BOX)[1]
    nve_init, nve_apply = simulate.nve(lambda R, neighbor, **_: energy_fn(
        R, neighbor=neighbor, species=species), shift, fw.DT)

    def one(rp):
        R, P0 = rp
        nbrs = nbrs0.update(R)
        state = nve_init(jax.random.PRNGKey(0), R, fw.KT, mass=fw.MASS,
                         neighbor=nbrs).set(momentum=P0)

        def step(carry, _):
            st, nb = carry
            st = nve_apply(st, neighbor=nb)
            nb = nb.update(st.position)
            return (st, nb), (st.momentum, nb.did_buffer_overflow)
        _, (Ps, over) = jax.lax.scan(step, (state, nbrs), None, length=steps)
        V = jnp.concatenate([P0[None], Ps]) / fw.MASS
        return jnp.einsum("tad,ad->t", V, V[0]) / V.shape[1], jnp.any(over)
    vacf, over = jax.jit(lambda R, P: jax.lax.map(one, (R, P)))(starts, P)
    if bool(jnp.any(over)):
        raise RuntimeError("a check segment overflowed its neighbor list")
    vacf = np.asarray(vacf, np.float64)
    return np.trapezoid(vacf, dx=fw.DT, axis=1) / 3.0, vacf.mean(0)


def block_error(values, blocks=10):
    v = np.asarray(values)[: len(values) // blocks * blocks].reshape(blocks, -1).mean(1)
    return float(np.std(v, ddof=1) / np.sqrt(blocks))


def model_and_labels(s, labels, seed):
    """The MACE plus prior (template, initial parameters) and the lambda-20
    labels split 160 / 40 into ``{'train', 'test'}``: the start of every
    trainer here (force-matched by ``fused_water.fm_trainer``)."""
    frames = {"R": labels["R"], "F": labels["F"],
              "species": np.full((len(labels["R"]), fw.N), 8)}
    data = {"train": {k: v[:160] for k, v in frames.items()},
            "test": {k: v[160:] for k, v in frames.items()}}
    return (*fw.with_prior(s, fw.mace_model(s, seed)), data)


def step_sizes(args):
    return optax.cosine_decay_schedule(args.lr, args.updates, alpha=0.1)


def dynamics_trainer(s, template, params, targets, D_target, args, folder):
    """Structure and D: the dynamics objective on one state point."""
    steps = check_steps(fw.DT, args.segment_ps)
    back = check_steps(fw.DT, args.backprop_ps) if args.backprop_ps else None
    spec = {"segment": dynamics.make_segment(template, space.periodic(fw.BOX)[1], fw.DT, steps,
                                             backprop_steps=back),
            "functionals": {"D": dynamics.diffusion()}, "quantities": s["quantities"],
            "targets": {"D": {"gamma": args.d_weight}, "rdf": {"gamma": 1.0},
                        "adf": {"gamma": 30.0}, "pressure": {"gamma": 1e-7}},
            "vmap_batch": 10}
    trainer = Reweighting(dynamics_objective(), args.seed, params,
                          freeze(optax.adam(step_sizes(args)), params, ["prior"]),
                          reuse=ReuseRule(pool=1), options=RunOptions(
                              progress=False, checkpoint_path=folder,
                              log_file=os.path.join(folder, "metrics.jsonl")))
    timings = process_printouts(fw.DT, 2.0 + SNAPSHOT_PS * args.segments, 2.0, SNAPSHOT_PS)
    fns = simulation_functions(template, s["simulator"], s["neighbor_fn"], timings, 10)
    trainer.add(fns, s["state_kwargs"], targets["frames"][-1], targets=spec["targets"],
                target_values={"D": D_target, "rdf": targets["rdf"], "adf": targets["adf"],
                               "pressure": targets["pressure"]},
                n_snapshots=timings.n_snapshots, spec=spec)
    return trainer


def plot(adf_degrees, target_adf, summary, path):
    """ADFs, VACFs and the dynamics trainer's D per update, from ``summary``
    (what ``results.json`` holds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, D_target = summary["rows"], summary["D_target"]
    fig, (ax_adf, ax_v, ax_d) = plt.subplots(1, 3, figsize=(15, 4))
    deg = np.asarray(adf_degrees)
    ax_adf.plot(deg, target_adf, "k--", lw=2, label="target (mW)")
    for name, r in rows.items():
        if "adf" in r:
            ax_adf.plot(deg, r["adf"], label=name)
        t = np.arange(len(r["vacf"])) * fw.DT
        ax_v.plot(t, r["vacf"], "k--" if "mW" in name else "-", lw=2 if "mW" in name else 1,
                  label=f"{name}: D {r['D'] * 1e3:.2f}e-3 nm^2/ps")
    per_update = 1e3 * np.asarray(summary["D_per_update"])
    ax_d.plot(np.arange(len(per_update)), per_update, "o-", label="the trainer's estimate")
    ax_d.axhline(1e3 * D_target, color="k", ls="--", label="target")
    ax_d.axhspan(0.95e3 * D_target, 1.05e3 * D_target, color="k", alpha=0.1, label="target +- 5 %")
    for name, marker in (("structure only (DiffTRe)", "s"), ("structure and D", "D")):
        if name in rows:
            ax_d.errorbar([len(per_update) - 0.5], [1e3 * rows[name]["D"]],
                          yerr=[1e3 * rows[name]["D_se"]], fmt=marker, capsize=3,
                          label=f"{name}: fresh check")
    ax_d.set(xlabel="update", ylabel="D (1e-3 nm^2/ps)", title="structure and D: D per update")
    ax_d.legend(fontsize=7)
    ax_adf.set(xlabel="angle (degrees)", ylabel="ADF", title="three-body structure")
    ax_v.set(xlabel="t (ps)", ylabel="<v(0).v(t)> (nm^2/ps^2)",
             title="velocity autocorrelation")
    ax_adf.legend(fontsize=7)
    ax_v.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")  # jax-md's SW
    out = functools.partial(os.path.join, args.out)
    if args.plot_from:
        with open(args.plot_from) as f:
            summary = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        plot(summary["adf_degrees"], summary["target_adf"], summary, out("water_diffusion.png"))
        return
    if os.path.isdir(args.out) and os.listdir(args.out):
        raise SystemExit(f"{args.out} already holds a run (metrics files and checkpoints, which "
                         f"this one would not overwrite): pass another --out or remove it.")
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    s = fw.system()
    ref = fw.reference(s, args.seed)
    targets, labels = ref["true"], ref["labels"]
    start = targets["frames"][-1]
    check = functools.partial(vacf_check, s, start=start, n_segments=args.check_segments,
                              segment_ps=args.segment_ps, seed=args.seed)
    mw, mw_neighbors = fw.mw_template(s, fw.LAMBDA_TRUE)
    D_ref, vacf_ref = check(mw, None, mw_neighbors)
    D_target = args.d_scale * float(D_ref.mean())
    rows = {"mW lambda 23.15 (the targets)": {
        "D": float(D_ref.mean()), "D_se": block_error(D_ref),
        "D_error": float(D_ref.mean()) / D_target - 1, "vacf": vacf_ref.tolist()}}
    print(f"targets ({time.perf_counter() - started:.0f} s): mW's D {D_ref.mean():.4e} +- "
          f"{block_error(D_ref):.1e} nm^2/ps over {args.segment_ps} ps; the D target "
          f"{D_target:.4e}", flush=True)

    template, init, data = model_and_labels(s, labels, args.seed)

    def measured(name, params, seconds):
        r = fw.measure(s, template, params, targets, start, data["test"], args.seed)
        D, vacf = check(template, params, s["neighbor_fn"])
        r.update(D=float(D.mean()), D_se=block_error(D), D_error=float(D.mean() / D_target - 1),
                 vacf=vacf.tolist(), seconds=seconds)
        rows[name] = r
        print(f"{name} ({seconds:.0f} s): D {r['D']:.4e} ({100 * r['D_error']:+.1f} +- "
              f"{100 * r['D_se'] / D_target:.1f} %), ADF MSE {r['adf_mse']:.2e}, RDF MSE "
              f"{r['rdf_mse']:.2e}, pressure {r['pressure_bar']:.0f} bar", flush=True)
        return r

    t = time.perf_counter()
    fm = fw.fm_trainer(s, template, init, data, out("fm"), args.fm_epochs, False)
    fm.train(args.fm_epochs)
    measured("force matching (the start)", fm.params, time.perf_counter() - t)

    t = time.perf_counter()
    dt = fw.difftre_trainer(s, template, fm.params, targets, start, out("difftre"), args.seed,
                            step_sizes(args), False)
    dt.initialize_trajstates()
    dt.train(args.updates)
    structure = measured("structure only (DiffTRe)", dt.params, time.perf_counter() - t)

    t = time.perf_counter()
    dyn = dynamics_trainer(s, template, fm.params, targets, D_target, args, out("dynamics"))
    dyn.initialize_trajstates()
    dyn.train(args.updates)
    both = measured("structure and D", dyn.params, time.perf_counter() - t)
    per_update = [e["statepoints"][0]["predictions"]["D"] for e in dyn.history]

    adf_ratio = both["adf_mse"] / structure["adf_mse"]
    summary = {"D_target": D_target, "D_error": both["D_error"], "adf_ratio": adf_ratio,
               "D_per_update": [float(d) for d in per_update],
               "grad_norms": [float(n) for e in dyn.history for n in e["grad_norms"]],
               "settings": vars(args),
               "seconds": time.perf_counter() - started, "rows": rows}
    lines = ["| model | D (1e-3 nm^2/ps) | D error | RDF MSE | ADF MSE | pressure (bar) | "
             "time (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        cells = [f"{r['rdf_mse']:.2e}", f"{r['adf_mse']:.2e}", f"{r['pressure_bar']:.0f}",
                 f"{r['seconds']:.0f}"] if "adf" in r else ["", "", "", ""]
        lines.append(f"| {name} | {1e3 * r['D']:.3f} +- {1e3 * r['D_se']:.3f} | "
                     f"{100 * r['D_error']:+.1f} % | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(out("results.md"), "w") as f:
        f.write(f"`python examples/difftre/water_diffusion.py {' '.join(_argv(args))}`, "
                f"{summary['seconds']:.0f} s in all\n\n{text}\n")
    print(text)
    summary["adf_degrees"] = np.degrees(np.asarray(s["adf_bins"].bin_centers)).tolist()
    summary["target_adf"] = np.asarray(targets["adf"]).tolist()
    with open(out("results.json"), "w") as f:
        json.dump(summary, f)
    plot(summary["adf_degrees"], summary["target_adf"], summary, out("water_diffusion.png"))
    print(f"structure and D: D {100 * both['D_error']:+.1f} % from the target, ADF MSE "
          f"{adf_ratio:.2f} x structure only's; {summary['seconds']:.0f} s in all", flush=True)


def _argv(args):
    return [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "plot_from"]


if __name__ == "__main__":
    main()

"""Is the trajectory part of a D gradient signal or noise? The cosine between
the gradients of two independent sets of 10 start states, against the NVE
segment's length, on the water beads of ``examples/difftre/water_diffusion.py``.

    .venv/bin/python benchmarks/dynamics_gradient_coherence.py   # about 8 min on 2 cores

The model is that example's start (the MACE plus prior, force-matched 20
epochs on the lambda-20 labels). 20 start states 0.25 ps apart from one NVT
trajectory (2 ps equilibration) get new Maxwell-Boltzmann momenta; for each
segment length the gradient of the mean Green-Kubo D over starts 0-9 and over
starts 10-19 (the MACE's parameters, not the prior's) is taken through the
segments (``chemtrain.learn.make_segment``), without reweighting. A cosine
near 1 says both sets point the same way; near 0 or below, that the gradient
is mostly noise. Prints one line per length; the last two lines are 1-ps
segments whose gradient is truncated (``make_segment(..., backprop_steps)``:
the reverse pass holds the state constant every 0.25 or 0.5 ps).
"""
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "difftre"))
import chemtrain  # noqa: F401,E402  (before jax_md)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax_md import space  # noqa: E402

import fused_water as fw  # noqa: E402
import water_diffusion as wd  # noqa: E402
from chemtrain.learn import dynamics  # noqa: E402
from chemtrain.learn.dynamics import check_steps  # noqa: E402
from chemtrain.simulate import make_trajectory, process_printouts, run_with_restart  # noqa: E402


# (segment ps, truncated backpropagation ps or None: exact)
CASES = ((0.25, None), (0.5, None), (1.0, None), (1.0, 0.25), (1.0, 0.5))


def flat(grads):
    return np.concatenate([np.ravel(np.asarray(x)) for k, v in grads.items() if k != "prior"
                           for x in jax.tree_util.tree_leaves(v)])


def prepare(seed: int = 0) -> dict:
    """The example's force-matched start and 20 start states (with new
    momenta) from one NVT trajectory of it: what both gradient benchmarks use."""
    warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")
    s = fw.system()
    ref = fw.reference(s, seed)
    targets = ref["true"]
    template, init, data = wd.model_and_labels(s, ref["labels"], seed)
    with tempfile.TemporaryDirectory() as folder:   # the force matching's checkpoints
        fm = fw.fm_trainer(s, template, init, data, folder, 20, False)
        fm.train(20)
    params = fm.params
    init_t, run = make_trajectory(s["simulator"], template, s["neighbor_fn"],
                                  process_printouts(fw.DT, 7.0, 2.0, 0.25))
    key = jax.random.PRNGKey(5)
    traj = run_with_restart(run, s["neighbor_fn"], params,
                            init_t(params, key, jnp.asarray(targets["frames"][-1]),
                                   **s["state_kwargs"]),
                            jax.random.fold_in(key, 1), **s["state_kwargs"])
    R = traj.snapshots.position[:20]
    P = jnp.sqrt(fw.MASS * fw.KT) * jax.random.normal(jax.random.fold_in(key, 2), R.shape)
    return {"system": s, "targets": targets, "template": template, "params": params,
            "R": R, "P": P, "nbrs0": s["neighbor_fn"].allocate(R[0], extra_capacity=8),
            "kwargs": {k: v for k, v in s["state_kwargs"].items() if k not in ("kT", "mass")}}


def mean_D_and_grad(prep: dict, segment_ps: float, backprop_ps: float | None):
    """``(params, R, P) -> (mean D, its gradient)`` through segments of
    ``segment_ps``, the gradient truncated to ``backprop_ps`` (None: exact)."""
    seg = dynamics.make_segment(prep["template"], space.periodic(fw.BOX)[1], fw.DT,
                                check_steps(fw.DT, segment_ps),
                                backprop_steps=backprop_ps and check_steps(fw.DT, backprop_ps))
    D_fn, nbrs0, kw = dynamics.diffusion(), prep["nbrs0"], prep["kwargs"]

    def mean_D(p, Rs, Ps):
        def one(rp):
            series, _ = seg(p, rp[0], rp[1], fw.MASS, nbrs0.update(rp[0]), kw)
            return D_fn(series, fw.DT)
        return jnp.mean(jax.lax.map(one, (Rs, Ps)))
    return jax.jit(jax.value_and_grad(mean_D))


def main():
    t0 = time.perf_counter()
    prep = prepare()
    params, R, P = prep["params"], prep["R"], prep["P"]
    print(f"model and start states ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    for ps, back in CASES:
        value_and_grad = mean_D_and_grad(prep, ps, back)
        t = time.perf_counter()
        (Da, ga), (Db, gb) = value_and_grad(params, R[:10], P[:10]), value_and_grad(
            params, R[10:], P[10:])
        a, b = flat(ga), flat(gb)
        cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        print(f"{ps} ps, backpropagation {back or 'exact'}: D {float(Da):.4e}, {float(Db):.4e} "
              f"nm^2/ps; |grad| {np.linalg.norm(a):.3g}, {np.linalg.norm(b):.3g}; "
              f"cosine {cos:+.3f} ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

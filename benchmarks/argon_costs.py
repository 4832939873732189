"""What an update of the argon diffusion example costs on this device: the
NVT sampling per ps, and the dynamic gradient per start state and ps with
the segments run one after another or vmapped in batches.

    python benchmarks/argon_costs.py [--batches 1,10,50] [--segment-ps 0.4]
        [--nvt-ps 2] [--modes cell,pairs,all]

Rahman's argon as in ``examples/difftre/argon_diffusion.py`` (864
Lennard-Jones atoms, 3.47786 nm box, Han and Yu's start sigma 0.338 nm,
epsilon 0.894 kJ/mol, cut at 1.0 nm, a Dense neighbor list, float32, 4 fs
steps), from the fcc lattice: only the cost is measured. Each figure is the
second call of a compiled function (the first compiles). ``--modes``:
``cell``, the example's neighbor list built with jax-md's cell list;
``pairs``, the same list built from all 864^2 distances (no cell list);
``all``, no list at all (``lennard_jones_template(..., all_pairs=True)``,
segments with ``neighbors=False``, a list that is never rebuilt for the
trainer's bookkeeping: the example's ``--all-pairs``).

Prints one line per measurement and a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, *args):
    import jax
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - started
    started = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, first, time.perf_counter() - started


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,10,50", help="start states per vmapped batch")
    p.add_argument("--segment-ps", type=float, default=0.4)
    p.add_argument("--nvt-ps", type=float, default=2.0)
    p.add_argument("--modes", default="cell,pairs,all")
    args = p.parse_args()

    import chemtrain  # noqa: F401
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_md import simulate, space

    from chemtrain.learn import dynamics as dyn
    from chemtrain.models.pair import lennard_jones_template
    from chemtrain.units import kT as kT_of
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "examples", "difftre"))
    from argon_diffusion import BOX, MASS, TEMPERATURE, lattice, neighbor_fn

    dt, kT = 0.004, kT_of(TEMPERATURE)
    disp, shift = space.periodic(BOX)
    params = {"sigma": jnp.asarray(0.338, jnp.float32), "epsilon": jnp.asarray(0.894, jnp.float32)}
    R = jnp.asarray(lattice())
    rows = []
    print(f"device: {jax.devices()[0].device_kind}, x64 {jax.config.jax_enable_x64}", flush=True)
    for mode in args.modes.split(","):
        template = lennard_jones_template(disp, 1.0, all_pairs=mode == "all")
        nbr_fn = neighbor_fn(disp, all_pairs=mode == "all", cell_list=mode == "cell")
        nbrs = nbr_fn.allocate(R)
        init, apply = simulate.nvt_langevin(template(params), shift, dt, kT, gamma=1.0)
        state = init(jax.random.PRNGKey(0), R, mass=MASS, neighbor=nbrs)
        n = round(args.nvt_ps / dt)

        @jax.jit
        def nvt(state, nbrs):
            def body(c, _):
                s, nb = c
                s = apply(s, neighbor=nb)
                return (s, nb.update(s.position)), None
            return jax.lax.scan(body, (state, nbrs), None, length=n)[0]
        (state, nbrs2), first, second = timed(nvt, state, nbrs)
        row = {"what": "nvt", "mode": mode, "s_per_ps": second / args.nvt_ps,
               "ms_per_step": 1e3 * second / n, "compile_and_run_s": first,
               "overflow": bool(nbrs2.did_buffer_overflow)}
        rows.append(row)
        print(json.dumps(row), flush=True)

        n_steps = dyn.check_steps(dt, args.segment_ps)
        segment = dyn.make_segment(template, shift, dt, n_steps, neighbors=mode != "all")
        for batch in [int(b) for b in args.batches.split(",")]:
            starts = 4 if batch == 1 else batch   # sequential: 4 start states
            keys = jax.random.split(jax.random.PRNGKey(1), starts)
            P = jnp.stack([jax.random.normal(k, R.shape, jnp.float32) * np.sqrt(MASS * kT)
                           for k in keys])
            snaps = simulate.NVEState(jnp.stack([state.position] * starts), P, jnp.zeros_like(P),
                                      jnp.full((starts,), MASS, jnp.float32))
            vg = jax.jit(dyn.make_value_and_grad(template, segment, {"D": dyn.diffusion()},
                                                 dyn.squared_error(), segment_batch=batch))
            vg_args = (params, [(snaps, nbrs)], jnp.zeros(starts, jnp.float32),
                       {"D": jnp.asarray(2.36e-3, jnp.float32)},
                       {"kT": jnp.asarray(kT, jnp.float32), "mass": jnp.asarray(MASS, jnp.float32)})
            ((loss, aux), grad), first, second = timed(vg, *vg_args)
            row = {"what": "gradient", "mode": mode, "segment_batch": batch,
                   "starts": starts, "segment_ps": args.segment_ps, "s": second,
                   "s_per_start_ps": second / starts / args.segment_ps,
                   "compile_and_run_s": first, "D": float(aux["predictions"]["D"]),
                   "overflow": int(aux["nbr_overflow"]),
                   "finite": bool(all(np.isfinite(np.asarray(g)) for g in jax.tree.leaves(grad)))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

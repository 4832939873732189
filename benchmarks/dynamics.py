"""Learning from dynamics: time and peak memory of one gradient of a
Green-Kubo diffusion loss against the NVE segment's length.

    .venv/bin/python benchmarks/dynamics.py [--lengths 1,2,5,10] [--starts 2] [--dt 0.004]
        [--block auto]

Rahman's liquid argon (Han and Yu's test): 864 Lennard-Jones atoms in a
3.47786 nm box (1.374 g/cm^3), sigma 0.338 nm, epsilon 0.894 kJ/mol (their
start), cut off at 1.0 nm with a smooth switch from 0.9 nm, mass 39.948
amu, a Dense neighbor list, float32 as on a GPU. The start states are the
fcc lattice with Maxwell-Boltzmann velocities at 94.4 K, one per
``--starts`` (their dynamics melts the lattice; only the cost is measured
here). Each segment length runs in a fresh process, so its peak resident
memory (``ru_maxrss``) is its own; XLA's own figure is the compiled
gradient program's temporary buffers (``memory_analysis``). The gradient is
:func:`chemtrain.learn.dynamics.make_value_and_grad` (the start states'
weights and the segments, checkpointed in blocks; ``--block 0``: no
checkpointing, every step's intermediates kept, for comparison).

Prints one line per length and a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(length: float, starts: int, dt: float, block) -> dict:
    sys.path.insert(0, os.path.dirname(HERE))
    import chemtrain  # noqa: F401
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_md import partition, simulate, space

    from chemtrain.learn import dynamics as dyn
    from chemtrain.learn.dynamics import check_steps
    from chemtrain.models.pair import lennard_jones_template
    from chemtrain.units import kT as kT_of

    box, n_cells = 3.47786, 6
    a = box / n_cells
    basis = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    cells = np.stack(np.meshgrid(*[np.arange(n_cells)] * 3, indexing="ij"), -1).reshape(-1, 3)
    R = jnp.asarray(((cells[:, None, :] + basis[None]) * a).reshape(-1, 3), jnp.float32)
    disp, shift = space.periodic(box)
    template = lennard_jones_template(disp, 1.0)
    nbr_fn = partition.neighbor_list(disp, box, 1.0, dr_threshold=0.1, capacity_multiplier=1.5,
                                     format=partition.NeighborListFormat.Dense)
    params = {"sigma": jnp.asarray(0.338, jnp.float32), "epsilon": jnp.asarray(0.894, jnp.float32)}
    kT, mass = kT_of(94.4), 39.948
    nbrs = nbr_fn.allocate(R)
    keys = jax.random.split(jax.random.PRNGKey(0), starts)
    P = jnp.stack([jax.random.normal(k, R.shape, jnp.float32) * np.sqrt(mass * kT) for k in keys])
    state = simulate.NVEState(jnp.stack([R] * starts), P, jnp.zeros_like(P),
                              jnp.full((starts,), mass, jnp.float32))
    U_ref = jnp.zeros(starts, jnp.float32)
    n_steps = check_steps(dt, length)
    blk = None if block == "auto" else (n_steps if int(block) == 0 else int(block))
    segment = dyn.make_segment(template, shift, dt, n_steps, block=blk)
    if block != "auto" and int(block) == 0:
        segment = _unchecked(segment, template, shift, dt, n_steps)
    vg = jax.jit(dyn.make_value_and_grad(template, segment, {"D": dyn.diffusion()},
                                         dyn.squared_error()))
    args = (params, [(state, nbrs)], U_ref, {"D": jnp.asarray(2.36e-3, jnp.float32)},
            {"kT": jnp.asarray(kT, jnp.float32), "mass": jnp.asarray(mass, jnp.float32)})
    started = time.perf_counter()
    compiled = vg.lower(*args).compile()
    compile_s = time.perf_counter() - started
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    started = time.perf_counter()
    (loss, aux), grad = jax.block_until_ready(compiled(*args))
    grad_s = time.perf_counter() - started
    return {"length_ps": length, "n_steps": n_steps, "block": segment.block, "starts": starts,
            "grad_s": round(grad_s, 2), "s_per_start_ps": round(grad_s / starts / length, 3),
            "compile_s": round(compile_s, 1), "xla_temp_mb": round(temp / 2 ** 20, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "D": float(aux["predictions"]["D"]), "finite": bool(np.all(np.isfinite(
                np.asarray(jax.tree.leaves(grad)))))}


def _unchecked(segment, template, shift, dt, n_steps):
    """The same segment with one plain scan (no checkpoints): reverse mode
    keeps every step's intermediates."""
    import jax
    from jax_md import simulate

    from chemtrain.quantity import dynamics as dq

    def plain(params, position, momentum, mass, nbrs, kwargs):
        init_fn, step_fn = simulate.nve(template(params), shift, dt)
        state = init_fn(None, position, 0.0, mass=mass, momenta=momentum, neighbor=nbrs)
        v0 = state.velocity

        def step(carry, _):
            s, nb = carry
            s = step_fn(s, neighbor=nb)
            return (s, nb.update(s.position)), dq.velocity_autocorrelation(v0, s.velocity)
        _, vacf = jax.lax.scan(step, (state, nbrs), None, length=n_steps)
        import jax.numpy as jnp
        return {"vacf": jnp.concatenate([dq.velocity_autocorrelation(v0, v0)[None], vacf])}, \
            jnp.asarray(False)
    plain.n_steps, plain.dt, plain.block = n_steps, dt, 0
    return plain


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1,2,5,10", help="segment lengths in ps")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--dt", type=float, default=0.004)
    p.add_argument("--block", default="auto", help="steps per checkpointed block; 0: none")
    p.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.starts, args.dt, args.block)))
        return
    rows = []
    for length in [float(x) for x in args.lengths.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--one", str(length), "--starts",
                              str(args.starts), "--dt", str(args.dt), "--block", args.block],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{length} ps: failed\n{out.stderr[-2000:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{length:5.1f} ps ({row['n_steps']} steps, block {row['block']}): gradient "
              f"{row['grad_s']} s ({row['s_per_start_ps']} s per start state and ps), peak RSS "
              f"{row['peak_rss_mb']} MB, XLA temporaries {row['xla_temp_mb']} MB, compile "
              f"{row['compile_s']} s", flush=True)
    if rows:
        first = rows[0]
        for r in rows:
            r["rss_ratio"] = round(r["peak_rss_mb"] / first["peak_rss_mb"], 3)
            r["xla_temp_ratio"] = round(r["xla_temp_mb"] / max(first["xla_temp_mb"], 1e-9), 3)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

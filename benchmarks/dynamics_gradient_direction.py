"""Does a D gradient say which way D moves? A step along each kind of
gradient, and D measured afresh before and after, on the water beads of
``examples/difftre/water_diffusion.py``.

    .venv/bin/python benchmarks/dynamics_gradient_direction.py   # about 21 min on 2 cores

From the force-matched start and the 20 start states of
``dynamics_gradient_coherence.py``, the gradient of the mean Green-Kubo D
(the MACE's parameters, not the prior's) is taken three ways: through 1-ps
segments exactly, through 1-ps segments truncated to 0.25 ps
(``make_segment(..., backprop_steps)``), and exactly through 0.25-ps
segments (the gradient of a D over 0.25 ps). The parameters then take one
step of the same length along each gradient, the length at which the
truncated gradient predicts D to rise by 10 %. D of the start and of each
stepped model is measured with the example's independent check
(``water_diffusion.vacf_check``: 200 start states of jax-md's NVE over 1 ps,
the same random numbers for every model). Prints, per gradient, the rise
its own slope predicts and the rise measured, with the check's standard
error.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dynamics_gradient_coherence as coh  # noqa: E402  (imports chemtrain before jax_md)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import water_diffusion as wd  # noqa: E402

CASES = ((1.0, 0.25), (1.0, None), (0.25, None))   # (segment ps, backpropagation ps)
RISE = 0.10


def fresh_D(prep, params):
    s = prep["system"]
    D, _ = wd.vacf_check(s, prep["template"], params, s["neighbor_fn"],
                         prep["targets"]["frames"][-1], 200, 1.0, 0)
    return float(D.mean()), wd.block_error(D)


def main():
    t0 = time.perf_counter()
    prep = coh.prepare()
    params = prep["params"]
    D0, se0 = fresh_D(prep, params)
    print(f"start ({time.perf_counter() - t0:.0f} s): fresh D {D0:.4e} +- {se0:.1e} nm^2/ps",
          flush=True)
    grads = {}
    for ps, back in CASES:
        t = time.perf_counter()
        D, g = coh.mean_D_and_grad(prep, ps, back)(params, prep["R"], prep["P"])
        g = {k: (jax.tree.map(np.zeros_like, v) if k == "prior" else v) for k, v in g.items()}
        grads[(ps, back)] = (float(D), g, float(np.linalg.norm(coh.flat(g))))
        print(f"gradient, {ps} ps, backpropagation {back or 'exact'}: D {float(D):.4e}, "
              f"|grad| {grads[(ps, back)][2]:.3g} ({time.perf_counter() - t:.0f} s)", flush=True)
    step = RISE * D0 / grads[CASES[0]][2]   # the truncated gradient's +10 %
    for (ps, back), (D, g, norm) in grads.items():
        stepped = jax.tree.map(lambda p, d: p + step / norm * d, params, g)
        D1, se1 = fresh_D(prep, stepped)
        print(f"step along {ps} ps, backpropagation {back or 'exact'}: predicted "
              f"{100 * step * norm / D0:+.1f} % (of its own D), measured "
              f"{100 * (D1 / D0 - 1):+.1f} +- {100 * np.hypot(se0, se1) / D0:.1f} % "
              f"(fresh D {D1:.4e})", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()

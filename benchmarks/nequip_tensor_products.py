"""NequIP's message tensor product: ours (planes of one component, fused
elementwise by XLA) against cuequivariance-jax's channel-wise tensor
product, the library MACE uses.

    .venv/bin/python benchmarks/nequip_tensor_products.py [--repeats 5] [--layers 1 2]
        [--method naive]

For each layer of SevenNet-0 and the edge and atom counts of the two
structures of ``benchmarks/nequip_vs_sevenn.py`` (the 64-atom Si cell: 1792
edges; the 370-atom nanotube: 14844 edges), the same operation two ways,
float32, on random inputs of the same shapes:

- ``ours``: :func:`chemtrain.models.nequip.model.messages`, what the model
  runs: the senders' features gathered as one (E, mul) plane per
  component, each path's output plane a sum of them times the edge's
  filters (spherical harmonics times Clebsch-Gordan) and the path's radial
  weights, summed onto the receivers;
- ``cuex``: ``cuequivariance.descriptors.channelwise_tensor_product`` of the
  same irreps (SO(3): SevenNet-0's features carry no parity) with the same
  paths and weights per edge, run by ``cuex.segmented_polynomial`` with the
  senders as input and the receivers as output indices (the way
  ``models/mace`` runs its convolution), with ``--method`` (default:
  MACE's, plain JAX ``'naive'`` on a CPU, the CUDA kernel ``'uniform_1d'``
  on a GPU where cuequivariance-ops-jax is installed).

Both start from the atoms' features and the radial MLP's last hidden layer
(its last weight is applied inside: per path in ours, once in theirs). It
times the forward pass and the forward plus the vector-Jacobian product
with respect to the features and the hidden layer (what training and
forces need), compiled, the median of ``--repeats``, and prints one line per case and a
JSON summary. The outputs are not compared (the two normalise and order
paths differently); the descriptor's path and weight counts are checked
against the model's.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

CASES = {"Si cell": (64, 1792), "nanotube": (370, 14844)}


def timed(fn, args, repeats):
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--method", default=None, help="cuequivariance-jax's execution method")
    args = p.parse_args()
    import cuequivariance as cue
    import cuequivariance_jax as cuex
    import jax
    import jax.numpy as jnp

    from chemtrain.models import nequip
    from chemtrain.models.mace.descriptors import default_method
    from chemtrain.models.nequip.model import conv_paths, ls_of, messages

    method = args.method or default_method()
    cfg, _ = nequip.load_sevennet("sevennet-0", trusted=True)
    rng = np.random.default_rng(0)
    rows = []
    for t in args.layers:
        x_ls = ls_of(cfg.irreps[t])
        out_ls = set(ls_of(cfg.irreps[t + 1]))
        paths = conv_paths(cfg, t)
        so3 = "+".join(f"{m}x{l}" for l, m in sorted(x_ls.items()))
        d = cue.descriptors.channelwise_tensor_product(
            cue.Irreps("SO3", so3), cue.Irreps("SO3", "+".join(
                f"1x{l}" for l in range(cfg.filter_lmax + 1))),
            [cue.SO3(l) for l in sorted(out_ls)])
        poly = d.polynomial
        n_weights = sum(x_ls[l1] for l1, _, _ in paths)
        assert poly.inputs[0].size == n_weights, (poly.inputs[0].size, n_weights)
        for name, (n, E) in CASES.items():
            senders = jnp.asarray(rng.integers(0, n, E))
            receivers = jnp.asarray(rng.integers(0, n, E))
            h = {l: jnp.asarray(rng.normal(size=(n, m, 2 * l + 1)), jnp.float32)
                 for l, m in x_ls.items()}
            sh = {l: jnp.asarray(rng.normal(size=(E, 2 * l + 1)), jnp.float32)
                  for l in range(cfg.filter_lmax + 1)}
            hidden = jnp.asarray(rng.normal(size=(E, 64)), jnp.float32)
            last = jnp.asarray(rng.normal(size=(64, n_weights)) / 8, jnp.float32)
            x_flat = jnp.asarray(rng.normal(size=(n, poly.inputs[1].size)), jnp.float32)
            sh_flat = jnp.asarray(rng.normal(size=(E, poly.inputs[2].size)), jnp.float32)
            out = jax.ShapeDtypeStruct((n, poly.outputs[0].size), jnp.float32)

            def ours(h, hidden):
                return messages(cfg, t, h, senders, sh, (hidden, last), receivers, n)

            def theirs(x, hidden):
                [m] = cuex.segmented_polynomial(poly, [hidden @ last, x, sh_flat], [out],
                                                indices=[None, senders, None, receivers],
                                                method=method)
                return m

            def with_vjp(fn):
                def run(x, w):   # the output too, or the forward pass would be dropped
                    y, back = jax.vjp(fn, x, w)
                    cot = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)
                                                         ).reshape(a.shape), y)
                    return y, back(cot)
                return jax.jit(run)

            row = {"layer": t, "structure": name, "atoms": n, "edges": E,
                   "paths": len(paths), "weights_per_edge": n_weights}
            row["ours_forward_ms"] = 1e3 * timed(jax.jit(ours), (h, hidden), args.repeats)
            row["cuex_forward_ms"] = 1e3 * timed(jax.jit(theirs), (x_flat, hidden), args.repeats)
            row["ours_vjp_ms"] = 1e3 * timed(with_vjp(ours), (h, hidden), args.repeats)
            row["cuex_vjp_ms"] = 1e3 * timed(with_vjp(theirs), (x_flat, hidden), args.repeats)
            rows.append(row)
            print(f"layer {t}, {name} ({E} edges, {len(paths)} paths): forward ours "
                  f"{row['ours_forward_ms']:.1f} ms, cuex {row['cuex_forward_ms']:.1f} ms; "
                  f"forward+vjp ours {row['ours_vjp_ms']:.1f} ms, cuex "
                  f"{row['cuex_vjp_ms']:.1f} ms", flush=True)
    print(json.dumps({"cores": os.cpu_count(), "jax": jax.__version__,
                      "cuequivariance_jax": cuex.__version__, "method": method,
                      "device": str(jax.devices()[0]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

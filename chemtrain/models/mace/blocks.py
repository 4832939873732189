"""The equivariant building blocks of the MACE model in
:mod:`chemtrain.models.mace.model`, on node features kept as lists of
``(n, irrep.dim, mul)`` blocks: splitting and flattening the blocks, e3nn's
equivariant linear layers (plain and element-dependent), the radial MLP,
the polynomial cutoff envelope, the Bessel radial basis, the ZBL pair
repulsion and the readouts (one output per head).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp

from chemtrain.models.mace.descriptors import irreps


def split_blocks(x, irreps_s: str):
    """Flat ir_mul array (n, dim) -> list of (n, ir.dim, mul) blocks."""
    out, i = [], 0
    for mul, ir in irreps(irreps_s):
        out.append(x[:, i:i + mul * ir.dim].reshape(x.shape[0], ir.dim, mul))
        i += mul * ir.dim
    return out


def flat(blocks):
    return jnp.concatenate([b.reshape(b.shape[0], -1) for b in blocks], axis=1)


def linear_instructions(irreps_in: str, irreps_out: str):
    """(i_in, i_out) pairs of e3nn's ``o3.Linear``, in its weight order."""
    a, b = irreps(irreps_in), irreps(irreps_out)
    return [(i, j) for i, (_, ir_i) in enumerate(a) for j, (_, ir_j) in enumerate(b) if ir_i == ir_j]


def _path_sum(weights: Sequence, blocks, irreps_in: str, irreps_out: str, product, fan_factor=1):
    """Each output block: the sum over e3nn's linear paths (:func:`linear_instructions`)
    of ``product(input block, path weight)``, over sqrt(fan-in); zeros where
    no path arrives."""
    a, b = irreps(irreps_in), irreps(irreps_out)
    instr = linear_instructions(irreps_in, irreps_out)
    n = blocks[0].shape[0]
    out = []
    for j, (mul_j, ir_j) in enumerate(b):
        terms = [(w, i) for w, (i, jj) in zip(weights, instr) if jj == j]
        if not terms:
            out.append(jnp.zeros((n, ir_j.dim, mul_j), blocks[0].dtype))
            continue
        fan = sum(a[i].mul * fan_factor for _, i in terms)
        out.append(sum(product(blocks[i], w) for w, i in terms) / math.sqrt(fan))
    return out


def linear(weights: Sequence, blocks, irreps_in: str, irreps_out: str):
    """e3nn ``o3.Linear`` (no biases): each output block sums the matching
    input blocks times a (mul_in, mul_out) matrix, over sqrt(fan-in)."""
    return _path_sum(weights, blocks, irreps_in, irreps_out, lambda x, w: x @ w)


def element_linear(weights: Sequence, blocks, element, irreps_in: str, irreps_out: str,
                   num_elements: int):
    """Element-dependent linear map: e3nn's ``FullyConnectedTensorProduct``
    of the features with the one-hot element (mace-torch's ``skip_tp``), on
    the paths of :func:`linear`; each weight has shape
    (mul_in, num_elements, mul_out)."""
    # gather each atom's (mul_in, mul_out) matrix: cost independent of the
    # number of elements the model knows
    return _path_sum(weights, blocks, irreps_in, irreps_out,
                     lambda x, w: jnp.einsum("ndu,nuw->ndw", x, jnp.moveaxis(w[:, element, :], 1, 0)),
                     fan_factor=num_elements)


def mlp(weights: Sequence, x, act_constant: float):
    """e3nn ``FullyConnectedNet``: no biases, weights over sqrt(fan-in),
    SiLU rescaled to unit second moment, none after the last layer."""
    for k, w in enumerate(weights):
        x = x @ w / math.sqrt(w.shape[0])
        if k < len(weights) - 1:
            x = act_constant * jax.nn.silu(x)
    return x


def polynomial_cutoff(r, r_max, p):
    x = r / r_max
    env = (1.0 - (p + 1.0) * (p + 2.0) / 2.0 * x ** p + p * (p + 2.0) * x ** (p + 1)
           - p * (p + 1.0) / 2.0 * x ** (p + 2))
    return jnp.where(r < r_max, env, 0.0)


def bessel(r, r_max, n):
    w = jnp.pi / r_max * jnp.arange(1, n + 1, dtype=r.dtype)
    return math.sqrt(2.0 / r_max) * jnp.sin(w * r[:, None]) / r[:, None]


def readout_mlp_irreps(cfg) -> str:
    """Irreps of the hidden layer of a nonlinear readout: ``cfg.mlp_irreps``
    once per head (mace-torch's ``len(heads) * MLP_irreps``, simplified)."""
    if cfg.num_heads == 1:
        return cfg.mlp_irreps
    blocks = irreps(cfg.mlp_irreps)
    if len(blocks) != 1:
        raise ValueError(f"A model of several heads needs 'mlp_irreps' of one kind, such as "
                         f"'16x0e', got {cfg.mlp_irreps!r}.")
    return f"{cfg.num_heads * blocks[0].mul}x{blocks[0].ir}"


def readout(p, h, layer, cfg):
    """A readout block (``layer.readout`` of the :class:`~chemtrain.models.mace.MaceConfig`
    ``cfg``) on the node features ``h``: node energies (n_atoms, num_heads),
    one column per head."""
    out = f"{cfg.num_heads}x0e"
    if layer.readout == "linear":
        return linear(p["linear"], h, layer.hidden_irreps, out)[0][:, 0, :]
    hidden = readout_mlp_irreps(cfg)
    x = linear(p["linear_1"], h, layer.hidden_irreps, hidden)
    x = [cfg.act_constant * jax.nn.silu(b) for b in x]
    w2 = p["linear_2"]
    if cfg.num_heads > 1:
        # mace-torch masks the hidden features to the head's block before
        # linear_2: head k's column reads only block k (same fan-in)
        mask = np.kron(np.eye(cfg.num_heads), np.ones((irreps(hidden).dim // cfg.num_heads, 1)))
        w2 = [w * mask.astype(w.dtype) for w in w2]
    return linear(w2, x, hidden, out)[0][:, 0, :]


def zbl(cfg, r, Z, senders, receivers, inside, n):
    """Ziegler-Biersack-Littmark repulsion as in mace-torch (per receiver,
    half of each directed edge)."""
    c0, c1, c2, c3, a_exp, a_pre = cfg.zbl
    zu, zv = Z[senders].astype(r.dtype), Z[receivers].astype(r.dtype)
    a = a_pre * 0.529 / (zu ** a_exp + zv ** a_exp)
    x = r / a
    phi = (c0 * jnp.exp(-3.2 * x) + c1 * jnp.exp(-0.9423 * x) + c2 * jnp.exp(-0.4028 * x)
           + c3 * jnp.exp(-0.2016 * x))
    v = 14.3996 * zu * zv / r * phi
    radii = jnp.asarray(cfg.covalent_radii, r.dtype)
    rmax = radii[Z[senders]] + radii[Z[receivers]]
    v = 0.5 * v * polynomial_cutoff(r, rmax, cfg.num_polynomial_cutoff)
    return jax.ops.segment_sum(jnp.where(inside, v, 0.0), receivers, num_segments=n)

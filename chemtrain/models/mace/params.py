"""MACE parameters: the shape of every leaf for a configuration (to load
saved models and export them) and random initialisation with mace-torch's
distributions (:func:`init_params`)."""
from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp

from .model import (RESIDUAL, MaceConfig, conv_descriptor, irreps, linear_instructions,
                    readout_mlp_irreps, sh_irreps_string, symmetric_descriptor)

def _linear_shapes(irreps_in: str, irreps_out: str, num_elements: int | None = None):
    a, b = irreps(irreps_in), irreps(irreps_out)
    if num_elements is None:
        return [(a[i].mul, b[j].mul) for i, j in linear_instructions(irreps_in, irreps_out)]
    return [(a[i].mul, num_elements, b[j].mul) for i, j in linear_instructions(irreps_in, irreps_out)]


def param_shapes(cfg: MaceConfig):
    """The parameter pytree of ``cfg`` with shape tuples as leaves.

    Loading saved models, converting mace-torch models and exporting them
    check parameters against it. The parameters themselves (from
    :func:`init_params`, :func:`chemtrain.models.mace.load` or
    :func:`chemtrain.models.mace.load_mace_torch`) have the same structure,
    with arrays of these shapes as leaves.

    Args:
      cfg: the model configuration.

    Returns:
      A dict with the keys ``"embedding"``, shape (num_elements, features),
      and ``"interactions"``, ``"products"`` and ``"readouts"``, lists with
      one entry per layer. ``interactions[t]`` holds the lists of shapes
      ``"linear_up"``, ``"radial_mlp"``, ``"linear"`` and ``"skip_tp"`` (the
      last element-dependent, (mul_in, num_elements, mul_out));
      ``products[t]`` holds ``"symmetric"``, shape
      (num_elements, paths * channels), and the list ``"linear"``;
      ``readouts[t]`` holds the list ``"linear"`` (linear readout) or the lists
      ``"linear_1"`` and ``"linear_2"`` (nonlinear readout). Linear weights are
      (mul_in, mul_out) matrices, one per e3nn path. A readout has one output
      per head (mace-torch's layout): ``linear`` maps to ``num_heads`` columns,
      column ``k`` head ``k``'s; a nonlinear readout's hidden layer has
      ``num_heads`` blocks of ``mlp_irreps`` (``linear_1`` writes block ``k``
      in columns ``k * K:(k + 1) * K``) and ``linear_2``, (num_heads * K,
      num_heads), maps block ``k`` to column ``k`` (its other entries are not
      used, as in mace-torch). A single head has exactly the shapes of
      chemtrain before heads.
    """
    sh = sh_irreps_string(cfg.max_ell)
    n_el = cfg.num_elements
    first = irreps(cfg.layers[0].node_irreps)
    tree = {"embedding": (n_el, first[0].mul), "interactions": [], "products": [], "readouts": []}
    for layer in cfg.layers:
        poly, mid = conv_descriptor(layer.edge_irreps, sh, layer.target_irreps)
        widths = (cfg.num_bessel, *cfg.radial_mlp, poly.inputs[0].size)
        skip = ((layer.node_irreps, layer.hidden_irreps) if layer.interaction == RESIDUAL
                else (layer.target_irreps, layer.target_irreps))
        tree["interactions"].append({
            "linear_up": _linear_shapes(layer.node_irreps, layer.edge_irreps),
            "radial_mlp": [(a, b) for a, b in zip(widths[:-1], widths[1:])],
            "linear": _linear_shapes(mid, layer.target_irreps),
            "skip_tp": _linear_shapes(*skip, num_elements=n_el),
        })
        sym_out = "+".join(f"{mul}x{ir}" for mul, ir in irreps(layer.hidden_irreps))
        spoly = symmetric_descriptor(layer.target_irreps, sym_out, layer.correlation)
        tree["products"].append({"symmetric": (n_el, spoly.inputs[0].size),
                                 "linear": _linear_shapes(layer.hidden_irreps, layer.hidden_irreps)})
        out, mlp_hidden = f"{cfg.num_heads}x0e", readout_mlp_irreps(cfg)
        if layer.readout == "linear":
            tree["readouts"].append({"linear": _linear_shapes(layer.hidden_irreps, out)})
        else:
            tree["readouts"].append({"linear_1": _linear_shapes(layer.hidden_irreps, mlp_hidden),
                                     "linear_2": _linear_shapes(mlp_hidden, out)})
    return tree


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _coupling_trees(in_irreps: str, x, nu: int, outs=None):
    """mace-torch's original symmetric-contraction basis, evaluated on the
    single-channel inputs ``x`` (samples, dim): the couplings
    (((x x) x) ...) of ``nu`` copies of ``x`` through every chain of
    intermediate irreps, with e3nn's Clebsch-Gordan coefficients in
    "component" normalisation. A list of ``(irrep, values (samples,
    irrep.dim))``, one per chain (only those ending in ``outs`` if given).
    For nu = 4 mace-torch keeps only intermediate irreps of natural parity
    (l < 12, p = (-1)^l)."""
    import e3nn_jax as e3nn
    factors, i = [], 0
    for _, ir in irreps(in_irreps):
        factors.append((ir, x[:, i:i + ir.dim]))
        i += ir.dim
    keep = (lambda ir: ir.l < 12 and ir.p == (-1) ** ir.l) if nu == 4 else (lambda ir: True)
    trees = list(factors)
    for step in range(nu - 1):
        last = step == nu - 2
        trees = [(ir_c, math.sqrt(ir_c.dim) * np.einsum(
                     "sa,sb,abc->sc", v, xb, np.asarray(e3nn.clebsch_gordan(ir_a.l, ir_b.l, ir_c.l))))
                 for ir_a, v in trees for ir_b, xb in factors for ir_c in ir_a * ir_b
                 if keep(ir_c) and not (last and outs is not None and ir_c not in outs)]
    return [t for t in trees if outs is None or t[0] in outs]


@functools.lru_cache(None)
def symmetric_init_map(target_irreps: str, hidden_irreps: str, correlation: int):
    """Matrix ``L`` (cuequivariance paths x paths): the cuequivariance
    symmetric-contraction weights ``L @ u``, ``u`` unit normal (drawn per
    element and channel), are distributed as those of a fresh mace-torch
    model converted by :func:`chemtrain.models.mace.load_mace_torch`.

    mace-torch draws, per output irrep and degree nu, one weight per coupling
    chain (:func:`_coupling_trees`), normal with std ``1/K`` for ``K``
    chains. The polynomial this defines (for one channel) is written in
    cuequivariance's paths by least squares on random inputs (as the
    converter maps weights), which gives the covariance of the path weights;
    ``L`` is its square root.
    """
    single_in = "+".join(f"1x{ir}" for _, ir in irreps(target_irreps))
    outs = [ir for _, ir in irreps(hidden_irreps)]
    poly = symmetric_descriptor(single_in, "+".join(f"1x{ir}" for ir in outs), correlation)
    n_cue, d_in = poly.inputs[0].size, poly.inputs[1].size
    offsets = np.cumsum([0] + [ir.dim for ir in outs])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(max(8, 3 * (n_cue // int(offsets[-1]) + 1)), d_in))
    columns = []     # (samples, outputs) per mace weight
    for nu in range(1, correlation + 1):
        trees = _coupling_trees(single_in, x, nu, outs)
        for o, ir in enumerate(outs):
            chosen = [v for ir_t, v in trees if ir_t == ir]
            for v in chosen:
                col = np.zeros((x.shape[0], int(offsets[-1])))
                col[:, offsets[o]:offsets[o + 1]] = v / len(chosen)
                columns.append(col.reshape(-1))
    A_ref = np.stack(columns, axis=1)
    [A_cue] = poly(np.eye(n_cue)[None], x[:, None, :])      # (samples, n_cue, outputs)
    A_c = np.transpose(A_cue, (0, 2, 1)).reshape(-1, n_cue)
    Q, *_ = np.linalg.lstsq(A_c, A_ref, rcond=None)
    err = np.linalg.norm(A_c @ Q - A_ref) / max(np.linalg.norm(A_ref), 1e-300)
    if err > 1e-6:
        raise RuntimeError(f"symmetric contraction initialisation: basis mismatch ({err:.1e})")
    lam, V = np.linalg.eigh(Q @ Q.T)
    return V * np.sqrt(np.clip(lam, 0.0, None))


def init_params(cfg: MaceConfig, key, dtype=jnp.float32):
    """Random MACE parameters, distributed as those of a fresh mace-torch model.

    The distribution is that of a freshly built mace-torch ``ScaleShiftMACE``
    (its default, e3nn, layers) converted with
    :func:`chemtrain.models.mace.load_mace_torch`. e3nn's ``o3.Linear``,
    ``FullyConnectedTensorProduct`` and ``FullyConnectedNet`` draw unit normal
    weights and normalise in the forward pass (over sqrt(fan-in), as
    ``linear``, ``element_linear`` and ``mlp`` of
    :mod:`chemtrain.models.mace.model` do): the embedding, the linear layers,
    the skip connections, the radial MLPs and the readouts are unit normal here
    too. The symmetric contractions follow mace-torch's original basis (see
    ``symmetric_init_map``; not the reduced basis mace-torch uses when
    cuequivariance-torch is installed): independent across elements and
    channels, correlated across cuequivariance's paths.

    Args:
      cfg: the model configuration.
      key: a JAX PRNG key.
      dtype: dtype of the parameters.

    Returns:
      The parameter pytree of ``cfg`` (structure and shapes of
      :func:`param_shapes`) with JAX arrays of ``dtype`` as leaves.

    Raises:
      RuntimeError: if a layer's symmetric-contraction basis cannot be matched
        to mace-torch's (a residual above 1e-6 in the least-squares fit).
    """
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(leaves))
    out = [jax.random.normal(k, s, dtype) for k, s in zip(keys, leaves)]
    params = jax.tree_util.tree_unflatten(treedef, out)
    for layer, p in zip(cfg.layers, params["products"]):
        L = symmetric_init_map(layer.target_irreps, layer.hidden_irreps, layer.correlation)
        n_el, size = p["symmetric"].shape
        u = p["symmetric"].reshape(n_el, L.shape[1], size // L.shape[1])   # unit normal
        p["symmetric"] = jnp.einsum("pr,zrc->zpc", jnp.asarray(L, dtype), u).reshape(n_el, size)
    return params


def zeros_like_shapes(cfg: MaceConfig, dtype=np.float32):
    shapes = param_shapes(cfg)
    return jax.tree_util.tree_map(lambda s: np.zeros(s, dtype), shapes, is_leaf=_is_shape)

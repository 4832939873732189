"""The MACE architecture of mace-torch's ``ScaleShiftMACE`` (RealAgnostic
interaction blocks), written in JAX.

Node features are kept as a list of blocks, one per ``(mul, irrep)`` of the
layer's irreps, each of shape ``(n_atoms, irrep.dim, mul)`` (the "ir_mul"
layout of cuequivariance). The two heavy equivariant operations, the
channel-wise tensor product of the messages (with the gather over senders and
the scatter over receivers) and the symmetric contraction, run as
cuequivariance-jax segmented polynomials; the equivariant linear layers are
per-irrep matrix products. Irreps follow e3nn's conventions (basis, ordering,
Clebsch-Gordan coefficients), so parameters of mace-torch models map onto
these without change (except the symmetric contraction, see
:mod:`chemtrain.models.mace.torch_io`).

The irreps bookkeeping and cuequivariance descriptors are in
:mod:`chemtrain.models.mace.descriptors`, the equivariant building blocks
in :mod:`chemtrain.models.mace.blocks`; their public names are re-exported here.

Lengths are in Angstrom and energies in eV here, as in mace-torch; the
chemtrain energy function (:func:`chemtrain.models.mace.energy_fn_template`)
converts.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from chemtrain.models.mace.blocks import (bessel,  # noqa: F401 - re-exported
                                          element_linear, flat, linear, linear_instructions,
                                          mlp, polynomial_cutoff, readout, readout_mlp_irreps,
                                          split_blocks, zbl)
from chemtrain.models.mace.config import (DEFAULT_HEADS, INTERACTIONS,  # noqa: F401 - re-exported
                                          PLAIN, RESIDUAL, Layer, MaceConfig)
from chemtrain.models.mace.descriptors import (  # noqa: F401 - re-exported
                                               conv_descriptor, cue_irreps,
                                               default_method, irreps, symmetric_descriptor)

# --------------------------------------------------------------------------
# the model

def node_energies(params, cfg: MaceConfig, vectors, senders, receivers, edge_mask,
                  element, node_mask, method: str | None = None, head=None,
                  vmap_safe: bool = True):
    """Per-atom energies (eV) of one structure, or of a batch of structures
    laid out as one graph with no edges between them.

    Lengths are in Angstrom and energies in eV, as in mace-torch. An atom's
    energy is its element's E0 plus ``scale * (sum of the readouts of all
    layers, plus the ZBL term if enabled) + shift``, with the E0s, scale,
    shift and readout output of the chosen head. Edges with ``edge_mask``
    False or longer than ``cfg.r_max`` contribute nothing. The ZBL repulsion is
    added half per directed edge, so the edges must hold both directions of
    every pair.

    Args:
      params: the parameter pytree of ``cfg`` (see
        :func:`chemtrain.models.mace.param_shapes`).
      cfg: the model configuration.
      vectors: edge vectors (n_edges, 3) in Angstrom, pointing from sender to
        receiver (``R[receiver] - R[sender]``), as in mace-torch.
      senders: sender atom index of each edge, integers (n_edges,).
      receivers: receiver atom index of each edge, integers (n_edges,).
      edge_mask: bool (n_edges,); False for edges that contribute nothing
        (their indices must still be in range).
      element: model element index of each atom (index into
        ``cfg.atomic_numbers``), integers (n_atoms,).
      node_mask: bool (n_atoms,); atoms with False get energy 0 (their element
        indices must still be in range). Edges to and from such atoms are not removed
        here: set ``edge_mask`` False for them too, as
        :func:`chemtrain.models.mace.energy_fn_template` does.
      method: cuequivariance-jax execution method; default: ``"uniform_1d"``
        (the CUDA kernel) on a GPU when cuequivariance-ops-jax is installed,
        ``"naive"`` (plain JAX) elsewhere.
      head: index of the head, an integer scalar, or one per atom (n_atoms,)
        for a batch whose structures use different heads (may be traced; not
        checked here: a traced scalar index out of range is clamped, a
        per-atom one gives NaN); None: head 0.
      vmap_safe: gather the senders' features and each atom's
        symmetric-contraction weights before cuequivariance-jax's
        polynomials, so that a ``jax.vmap`` of this function differentiates
        correctly (cuequivariance-jax 0.13 gets the gradient of an indexed,
        un-batched input wrong under vmap). False: pass them through its
        ``indices`` (faster, less memory), for callers that do not vmap it
        over structures (the batched energies of
        :func:`chemtrain.models.mace.energy_fn_template`).

    Returns:
      The energy of each atom, shape (n_atoms,) in eV (0 where ``node_mask`` is
      False).
    """
    import cuequivariance_jax as cuex
    import e3nn_jax as e3nn

    method = method or default_method()
    n = element.shape[0]
    dtype = vectors.dtype
    Z = jnp.asarray(cfg.atomic_numbers)[element]

    d2 = jnp.sum(vectors ** 2, axis=-1)
    r_raw = jnp.sqrt(jnp.where(edge_mask, d2, 1.0))
    inside = edge_mask & (r_raw < cfg.r_max)
    r = jnp.where(inside, r_raw, 0.5 * cfg.r_max)
    safe_vec = jnp.where(inside[:, None], vectors, jnp.array([0.0, 0.0, 1.0], dtype))

    # radial features, with mace's optional Agnesi transform before the basis
    cutoff = polynomial_cutoff(r, cfg.r_max, cfg.num_polynomial_cutoff)
    rb = r
    if cfg.distance_transform == "Agnesi":
        q, p, a = cfg.agnesi
        radii = jnp.asarray(cfg.covalent_radii, dtype)
        r0 = 0.5 * (radii[Z[senders]] + radii[Z[receivers]])
        x = r / r0
        rb = 1.0 / (1.0 + a * x ** q / (1.0 + x ** (q - p)))
    radial = bessel(rb, cfg.r_max, cfg.num_bessel) * (cutoff * inside)[:, None]

    sh_irreps = sh_irreps_string(cfg.max_ell)
    sh = e3nn.spherical_harmonics(sh_irreps, safe_vec, normalize=True, normalization="component").array
    sh = sh * inside[:, None]

    pair = zbl(cfg, r, Z, senders, receivers, inside, n) if cfg.pair_repulsion else 0.0
    reads = []

    onehot_w = params["embedding"]  # (num_elements, features)
    h = [(onehot_w[element] / math.sqrt(cfg.num_elements))[:, None, :]]

    for layer, p_int, p_prod, p_read in zip(cfg.layers, params["interactions"],
                                            params["products"], params["readouts"]):
        sc = None
        if layer.interaction == RESIDUAL:
            sc = element_linear(p_int["skip_tp"], h, element, layer.node_irreps,
                                layer.hidden_irreps, cfg.num_elements)
        hu = linear(p_int["linear_up"], h, layer.node_irreps, layer.edge_irreps)
        tp_w = mlp(p_int["radial_mlp"], radial, cfg.act_constant)
        poly, mid = conv_descriptor(layer.edge_irreps, sh_irreps, layer.target_irreps)
        # vmap_safe: the senders' features are gathered here, not passed
        # through cuex's ``indices``: under jax.vmap over snapshots that share
        # their species (DiffTRe) the features of the first layer are
        # un-batched, and cuequivariance-jax 0.13 then gets their gradient
        # wrong (see below)
        [msg] = cuex.segmented_polynomial(
            poly, [tp_w, flat(hu)[senders] if vmap_safe else flat(hu), sh],
            [jax.ShapeDtypeStruct((n, poly.outputs[0].size), dtype)],
            indices=[None, None if vmap_safe else senders, None, receivers], method=method)
        msg = linear(p_int["linear"], split_blocks(msg, mid), mid, layer.target_irreps)
        msg = [m / cfg.avg_num_neighbors for m in msg]
        if layer.interaction == PLAIN:
            msg = element_linear(p_int["skip_tp"], msg, element, layer.target_irreps,
                                 layer.target_irreps, cfg.num_elements)
        sym_out = "+".join(f"{mul}x{ir}" for mul, ir in irreps(layer.hidden_irreps))
        spoly = symmetric_descriptor(layer.target_irreps, sym_out, layer.correlation)
        # vmap_safe: each atom's weights are gathered here rather than passed through
        # cuex's ``indices``: with cuequivariance-jax 0.13 the gradient of an
        # indexed, un-batched input is wrong under jax.vmap (as MD, calculators
        # and DiffTRe's potential-dependent quantities call the single-structure
        # energy); tests/models/mace/test_model.py checks the gradient.
        [hs] = cuex.segmented_polynomial(
            spoly, [p_prod["symmetric"][element] if vmap_safe else p_prod["symmetric"], flat(msg)],
            [jax.ShapeDtypeStruct((n, spoly.outputs[0].size), dtype)],
            indices=None if vmap_safe else [element, None, None], method=method)
        h = linear(p_prod["linear"], split_blocks(hs, layer.hidden_irreps),
                   layer.hidden_irreps, layer.hidden_irreps)
        if sc is not None:
            h = [a + b for a, b in zip(h, sc)]
        reads.append(readout(p_read, h, layer, cfg))

    # every readout gives one column per head: sum them, then take the head's
    hd = jnp.zeros((), jnp.int32) if head is None else jnp.asarray(head)
    scales, shifts = (jnp.asarray(x, dtype) for x in cfg.scale_shift_per_head())
    read = sum(reads)
    read = read[:, hd] if hd.ndim == 0 else jnp.take_along_axis(read, hd[:, None], axis=1)[:, 0]
    inter = scales[hd] * (read + pair) + shifts[hd]
    e0 = jnp.asarray(cfg.atomic_energies_per_head(), dtype)[hd, element]
    return jnp.where(node_mask, e0 + inter, 0.0)


def sh_irreps_string(max_ell: int) -> str:
    return "+".join(f"1x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(max_ell + 1))

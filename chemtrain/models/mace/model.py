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

import dataclasses
import json
import math

import numpy as np
import jax
import jax.numpy as jnp

from chemtrain.models.mace.blocks import (bessel,  # noqa: F401 - re-exported
                                          element_linear, flat, linear, linear_instructions,
                                          mlp, polynomial_cutoff, readout, readout_mlp_irreps,
                                          split_blocks, zbl)
from chemtrain.models.mace.descriptors import (  # noqa: F401 - re-exported
                                               conv_descriptor, cue_irreps,
                                               default_method, irreps, symmetric_descriptor)

RESIDUAL = "RealAgnosticResidualInteractionBlock"
DEFAULT_HEADS = ("Default",)   # mace-torch's name of a single-head model's head
PLAIN = "RealAgnosticInteractionBlock"
INTERACTIONS = (PLAIN, RESIDUAL)


@dataclasses.dataclass(frozen=True)
class Layer:
    """Irreps of one interaction + product layer (e3nn strings).

    A frozen dataclass, plain data (part of :class:`MaceConfig`'s JSON).

    Args:
      interaction: the mace-torch interaction block,
        ``"RealAgnosticResidualInteractionBlock"`` (with a skip connection from
        the input node features) or ``"RealAgnosticInteractionBlock"``.
      node_irreps: irreps of the input node features, e.g. ``"128x0e"``.
      edge_irreps: irreps after ``linear_up`` (the tensor product's node input).
      target_irreps: irreps of the tensor-product filter, the input of the
        symmetric contraction.
      hidden_irreps: irreps of the output of the product block (the next
        layer's ``node_irreps``).
      correlation: the highest degree (nu) of the symmetric contraction, >= 1.
      readout: ``"linear"`` or ``"nonlinear"`` (an MLP through
        :attr:`MaceConfig.mlp_irreps`).
    """
    interaction: str          # RESIDUAL or PLAIN
    node_irreps: str          # input node features
    edge_irreps: str          # after linear_up (tensor product input)
    target_irreps: str        # tensor-product filter / symmetric contraction input
    hidden_irreps: str        # output of the product block
    correlation: int
    readout: str              # "linear" or "nonlinear"


@dataclasses.dataclass(frozen=True)
class MaceConfig:
    """Everything of a MACE model but the trainable parameters; plain data (JSON).

    A frozen dataclass. Lengths are in Angstrom and energies in eV, as in
    mace-torch. :func:`chemtrain.models.mace.config_from_json` reads and checks
    the JSON of :meth:`to_json`.

    Args:
      atomic_numbers: atomic numbers of the elements the model knows, distinct
        and in increasing order; element index ``i`` of the model is
        ``atomic_numbers[i]``.
      r_max: cutoff radius in Angstrom.
      num_bessel: number of Bessel radial basis functions.
      num_polynomial_cutoff: exponent p of the polynomial cutoff envelope.
      max_ell: highest degree l of the spherical harmonics of edge directions.
      avg_num_neighbors: the messages summed on each atom are divided by this.
      radial_mlp: hidden widths of the radial MLP that maps the Bessel features
        to the tensor-product weights.
      layers: one :class:`Layer` per interaction; each layer's
        ``node_irreps`` are the previous layer's ``hidden_irreps``.
      mlp_irreps: irreps of the hidden layer of nonlinear readouts, per head
        (mace-torch's ``MLP_irreps``; a model of ``H`` heads has ``H`` times
        as many hidden features, head ``h`` reading only its own block).
      atomic_energies: E0s, the energy in eV of each element in the order of
        ``atomic_numbers``, added to each atom's energy. One tuple per head,
        ``((head 0's E0s), (head 1's E0s), ...)``, for a model of several
        heads; a flat tuple for a single head.
      scale: factor applied to each atom's interaction energy (the summed
        readouts of all layers plus the ZBL term); a tuple of one per head
        for several heads, a number for one.
      shift: added, in eV, to each atom's scaled interaction energy; per head
        as ``scale``.
      act_constant: e3nn's normalize2mom constant of SiLU (the factor of SiLU in
        the radial MLP and nonlinear readouts).
      distance_transform: None or ``"Agnesi"`` (Agnesi transform of the
        distance before the Bessel basis).
      agnesi: the Agnesi transform's ``(q, p, a)``.
      pair_repulsion: whether the ZBL pair repulsion is added.
      zbl: ZBL parameters ``(c0, c1, c2, c3, a_exp, a_prefactor)``.
      covalent_radii: covalent radii in Angstrom indexed by atomic number
        (used by the Agnesi transform and the ZBL repulsion).
      heads: names of the heads, distinct; default ``("Default",)``, what
        mace-torch calls the head of a single-head model. Every layer is shared;
        each head has its own readout output (one column of every readout),
        E0s, scale and shift. Head ``i`` is ``heads[i]`` (the ``head`` index of
        :func:`node_energies` and the energy function); mace-torch's
        multi-head fine-tuning puts the foundation model's head, ``"pt_head"``,
        first.
    """
    atomic_numbers: tuple[int, ...]
    r_max: float
    num_bessel: int
    num_polynomial_cutoff: int
    max_ell: int
    avg_num_neighbors: float
    radial_mlp: tuple[int, ...]
    layers: tuple[Layer, ...]
    mlp_irreps: str
    atomic_energies: tuple[float, ...] | tuple[tuple[float, ...], ...]  # eV per element (per head)
    scale: float | tuple[float, ...]
    shift: float | tuple[float, ...]
    act_constant: float                    # e3nn's normalize2mom constant of SiLU
    distance_transform: str | None = None  # None or "Agnesi"
    agnesi: tuple[float, float, float] = (0.9183, 4.5791, 1.0805)   # q, p, a
    pair_repulsion: bool = False
    zbl: tuple[float, ...] = (0.1818, 0.5099, 0.2802, 0.02817, 0.300, 0.4543)  # c0..c3, a_exp, a_prefactor
    covalent_radii: tuple[float, ...] = ()  # Angstrom, indexed by atomic number
    heads: tuple[str, ...] = DEFAULT_HEADS

    def to_json(self) -> str:
        """Serialize the configuration to a JSON string.

        Numpy scalars (e.g. atomic numbers taken from an array) are written as plain
        numbers, other objects JSON cannot hold as their ``str``. The ``heads``
        field is left out when it is the default ``("Default",)``, so that a
        single-head model's JSON is what chemtrain wrote before it knew heads.

        Returns:
          The JSON text of all fields (read back with :meth:`from_json` or, checked,
          :func:`chemtrain.models.mace.config_from_json`).
        """
        d = dataclasses.asdict(self)
        if tuple(self.heads) == DEFAULT_HEADS:
            del d["heads"]   # readable by chemtrain versions without heads
        # numpy scalars (e.g. atomic numbers taken from an array) as plain numbers
        return json.dumps(d, default=lambda x: x.item() if hasattr(x, "item") else str(x))

    @classmethod
    def from_json(cls, text: str) -> "MaceConfig":
        """Build a configuration from the JSON of :meth:`to_json`, unchecked.

        The values are not validated; for text from a file use
        :func:`chemtrain.models.mace.config_from_json`, which checks every field.

        Args:
          text: the JSON string.

        Returns:
          The :class:`MaceConfig`.

        Raises:
          json.JSONDecodeError: if ``text`` is not valid JSON.
          KeyError: if ``layers`` or a tuple-valued field (including ``agnesi``,
            ``zbl`` and ``covalent_radii``) is missing.
          TypeError: if a field is unknown or a required one is missing.
        """
        d = json.loads(text)
        d["layers"] = tuple(Layer(**layer) for layer in d["layers"])
        for key in ("atomic_numbers", "radial_mlp", "atomic_energies", "agnesi", "zbl", "covalent_radii"):
            d[key] = _tuples(d[key])
        for key in ("scale", "shift", "heads"):
            if key in d:
                d[key] = _tuples(d[key])
        return cls(**d)

    @property
    def num_elements(self) -> int:
        """Number of elements the model knows (``len(atomic_numbers)``)."""
        return len(self.atomic_numbers)

    @property
    def num_heads(self) -> int:
        """Number of heads (``len(heads)``)."""
        return len(self.heads)

    def head_index(self, head) -> int:
        """The index of a head given by name or index.

        Args:
          head: a head name (one of :attr:`heads`) or an integer index
            ``0 <= head < num_heads`` (negative indices count from the end).

        Returns:
          The index into :attr:`heads`.

        Raises:
          ValueError: naming the heads there are, for an unknown name or an
            index out of range.
        """
        if isinstance(head, str):
            if head not in self.heads:
                raise ValueError(f"The MACE model has no head {head!r}; its heads are "
                                 f"{list(self.heads)}.")
            return self.heads.index(head)
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)):
            raise ValueError(f"A head is a name or an integer index, got {head!r}; the heads are "
                             f"{list(self.heads)}.")
        if not -self.num_heads <= head < self.num_heads:
            raise ValueError(f"Head index {int(head)} is out of range: the MACE model has "
                             f"{self.num_heads} head(s) {list(self.heads)}.")
        return int(head) % self.num_heads

    def atomic_energies_per_head(self) -> np.ndarray:
        """The E0s as a float64 array (num_heads, num_elements), one row per head.

        Raises:
          ValueError: if ``atomic_energies`` is not laid out for the heads (a
            flat tuple for one head, one tuple per head for several).
        """
        e0 = np.asarray(self.atomic_energies, np.float64)
        e0 = e0[None] if self.num_heads == 1 and e0.ndim == 1 else e0
        if e0.shape != (self.num_heads, self.num_elements):
            raise ValueError(f"atomic_energies of shape {e0.shape} do not fit {self.num_heads} "
                             f"head(s) {list(self.heads)} and {self.num_elements} elements: give "
                             f"one tuple of E0s per head (a flat tuple for one head).")
        return e0

    def scale_shift_per_head(self) -> tuple[np.ndarray, np.ndarray]:
        """Scale and shift as two float64 arrays (num_heads,), one entry per head.

        Raises:
          ValueError: if ``scale`` or ``shift`` is not laid out for the heads (a
            number for one head, a tuple of one per head for several).
        """
        out = []
        for key in ("scale", "shift"):
            x = np.asarray(getattr(self, key), np.float64)
            if x.shape != (() if self.num_heads == 1 else (self.num_heads,)):
                raise ValueError(f"{key} of shape {x.shape} does not fit {self.num_heads} head(s) "
                                 f"{list(self.heads)}: give a number for one head, a tuple of one "
                                 f"per head for several.")
            out.append(x.reshape(self.num_heads))
        return tuple(out)

    def element_table(self) -> np.ndarray:
        """Lookup table from atomic number to the model's element index.

        Returns:
          An int32 array of shape (119,) whose entry Z is the index of atomic number
          Z in ``atomic_numbers``, or -1 if the model does not know Z.
        """
        table = np.full(119, -1, np.int32)
        table[list(self.atomic_numbers)] = np.arange(self.num_elements)
        return table


# --------------------------------------------------------------------------
# the model

def _tuples(x):
    """JSON lists (nested) as tuples."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


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

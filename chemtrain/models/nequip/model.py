"""The NequIP-type network of SevenNet (sevenn's ``E3GNN``) in JAX.

Features are kept per angular momentum ``l`` as arrays (N, mul, 2l+1) in
e3nn's real basis (SO(3): every irrep even). One interaction layer is, as
sevenn builds it:

    sc = Linear(x)                                  self-connection of the input
    h  = Linear(x)
    m  = sum over edges j -> i of TP_uvu(h_j, Y(r_ij), MLP(basis(|r_ij|))) / denominator
    x' = Gate(Linear(m) + sc)

with e3nn's normalisations applied at run time: a linear divides by the
square root of its fan-in, a tensor-product path (l1, l2 -> l3) carries
sqrt(2 l3 + 1) times the Clebsch-Gordan coefficients (``e3nn_jax``, equal
to e3nn's ``wigner_3j``), and the activation is e3nn's second-moment
normalised SiLU (its constant :data:`SILU_CONSTANT`, which e3nn estimates by
sampling and SevenNet's weights were trained with). The readout is two
linears, then a per-element scale and shift: atomic energies in eV
(lengths in Angstrom).
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from chemtrain.models.species import element_table

#: e3nn's normalize2mom constant of SiLU (the mean of silu(z)^2 over 10^6
#: samples of torch's generator, seed 0): not the exact Gaussian moment
#: 1.67653..., which changes SevenNet-0's energies by 4e-4 to 3e-3 relative
SILU_CONSTANT = 1.6791767923989418


@dataclasses.dataclass(frozen=True)
class NequipConfig:
    """The architecture (plain data; lengths in Angstrom, energies in eV).

    Attributes:
      atomic_numbers: the element of each model index (sevenn's type map).
      cutoff: the radial cutoff.
      cutoff_function: ``'xplor'`` (1 below ``cutoff_on``, then a smooth
        switch to 0 at ``cutoff``) or ``'poly'`` (the polynomial envelope of
        order ``poly_p`` in r / cutoff).
      cutoff_on, poly_p: the cutoff function's parameter.
      n_basis: Bessel functions of the edge length (trainable frequencies).
      irreps: the node features of each layer, from the embedding's to the
        last layer's, each a tuple of (multiplicity, l).
      filter_lmax: the spherical harmonics of the edge direction, l <= it.
      radial_hidden: hidden widths of each layer's radial MLP.
      denominators: per layer, what the sum of messages is divided by.
      normalize_sph: spherical harmonics of the unit edge vector (True) or
        of the edge vector itself.
    """
    atomic_numbers: tuple
    cutoff: float
    cutoff_function: str
    cutoff_on: float
    poly_p: int
    n_basis: int
    irreps: tuple
    filter_lmax: int
    radial_hidden: tuple
    denominators: tuple
    normalize_sph: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.irreps) - 1

    @property
    def num_elements(self) -> int:
        return len(self.atomic_numbers)

    def element_table(self) -> np.ndarray:
        """(119,) model index of each atomic number, -1 where unknown
        (:func:`chemtrain.models.species.element_table`)."""
        return element_table(self.atomic_numbers)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "NequipConfig":
        d = dict(d)
        d["atomic_numbers"] = tuple(int(z) for z in d["atomic_numbers"])
        d["irreps"] = tuple(tuple((int(m), int(l)) for m, l in layer) for layer in d["irreps"])
        d["radial_hidden"] = tuple(int(h) for h in d["radial_hidden"])
        d["denominators"] = tuple(float(x) for x in d["denominators"])
        return cls(**d)


def ls_of(irreps) -> dict:
    """{l: multiplicity} of one layer's irreps (one block per l)."""
    return {l: m for m, l in irreps}


def gate_inputs(irreps_out) -> dict:
    """{l: multiplicity} of the gate's input: the scalars, then one gate
    scalar per channel of l > 0, then the gated channels."""
    out = ls_of(irreps_out)
    gated = sum(m for l, m in out.items() if l > 0)
    return {0: out[0] + gated, **{l: m for l, m in out.items() if l > 0}}


def conv_paths(cfg: NequipConfig, layer: int) -> tuple:
    """The tensor-product paths (l1, l2, l3) of ``layer`` in the order of its
    radial MLP's output columns (and of the message channels): sorted by l3,
    within one l3 in e3nn's order of generation (l1 of the input, l2 of the
    filter, l3 ascending)."""
    return tuple(sorted(generated_paths(cfg, layer), key=lambda p: p[2]))


def generated_paths(cfg: NequipConfig, layer: int) -> tuple:
    """The same paths in e3nn's order of generation (the column order of
    checkpoints of sevenn before 0.11)."""
    x, out = ls_of(cfg.irreps[layer]), set(ls_of(cfg.irreps[layer + 1]))
    return tuple((l1, l2, l3) for l1 in sorted(x) for l2 in range(cfg.filter_lmax + 1)
                 for l3 in range(abs(l1 - l2), l1 + l2 + 1) if l3 in out)


def message_ls(cfg: NequipConfig, layer: int) -> dict:
    """{l3: multiplicity} of the summed messages of ``layer``."""
    x = ls_of(cfg.irreps[layer])
    out: dict = {}
    for l1, _, l3 in conv_paths(cfg, layer):
        out[l3] = out.get(l3, 0) + x[l1]
    return out


def param_shapes(cfg: NequipConfig) -> dict:
    """The parameter pytree's shapes (the structure of :func:`node_energies`'s params).

    Args:
      cfg: the architecture.

    Returns:
      The pytree of :func:`init_params` with a shape tuple at every leaf:
      ``basis`` (Bessel frequencies), ``embedding`` (elements x channels),
      per layer ``self_connection``, ``linear_1`` and ``linear_2`` ({'l<l>':
      (fan-in, fan-out)}) and ``radial`` (the MLP's matrices), ``readout``
      (two matrices), ``scale`` and ``shift`` (per element).
    """
    c0 = ls_of(cfg.irreps[0])[0]
    layers = []
    for t in range(cfg.num_layers):
        x, gate = ls_of(cfg.irreps[t]), gate_inputs(cfg.irreps[t + 1])
        msg = message_ls(cfg, t)
        n_w = sum(x[l1] for l1, _, _ in conv_paths(cfg, t))
        widths = (cfg.n_basis, *cfg.radial_hidden, n_w)
        layers.append({
            "self_connection": {f"l{l}": (x[l], gate[l]) for l in sorted(x) if l in gate},
            "linear_1": {f"l{l}": (x[l], x[l]) for l in sorted(x)},
            "radial": [(a, b) for a, b in zip(widths[:-1], widths[1:])],
            "linear_2": {f"l{l}": (msg[l], gate[l]) for l in sorted(msg) if l in gate}})
    last = ls_of(cfg.irreps[-1])[0]
    return {"basis": (cfg.n_basis,), "embedding": (cfg.num_elements, c0), "layers": layers,
            "readout": [(last, last // 2), (last // 2, 1)],
            "scale": (cfg.num_elements,), "shift": (cfg.num_elements,)}


def init_params(key, cfg: NequipConfig, dtype=jnp.float64) -> dict:
    """Random parameters (unit normal weights, as e3nn initialises them;
    Bessel frequencies n pi / cutoff, scale 1, shift 0).

    Args:
      key: a JAX random key.
      cfg: the architecture.
      dtype: of every parameter.
    """
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple)
                                       and all(isinstance(i, int) for i in s))
    keys = jax.random.split(key, len(leaves))
    params = jax.tree.unflatten(treedef, [jax.random.normal(k, s, dtype)
                                          for k, s in zip(keys, leaves)])
    params["basis"] = jnp.arange(1, cfg.n_basis + 1, dtype=dtype) * jnp.pi / cfg.cutoff
    params["scale"] = jnp.ones(cfg.num_elements, dtype)
    params["shift"] = jnp.zeros(cfg.num_elements, dtype)
    return params


def act(x):
    return SILU_CONSTANT * jax.nn.silu(x)


@lru_cache(maxsize=None)
def _cg(l1: int, l2: int, l3: int) -> np.ndarray:
    import e3nn_jax
    return np.asarray(e3nn_jax.clebsch_gordan(l1, l2, l3)) * math.sqrt(2 * l3 + 1)


def _cutoff(cfg: NequipConfig, r):
    rc = cfg.cutoff
    if cfg.cutoff_function == "xplor":
        on = cfg.cutoff_on
        switch = (rc ** 2 - r ** 2) ** 2 * (rc ** 2 + 2 * r ** 2 - 3 * on ** 2) \
            / (rc ** 2 - on ** 2) ** 3
        return jnp.where(r < on, 1.0, switch)
    p, u = cfg.poly_p, r / rc
    return (1 - (p + 1) * (p + 2) / 2 * u ** p + p * (p + 2) * u ** (p + 1)
            - p * (p + 1) / 2 * u ** (p + 2))


def _linear(weights: dict, x: dict) -> dict:
    """e3nn's ``o3.Linear`` between one block per l: x_l W_l / sqrt(fan-in)."""
    out = {}
    for name, w in weights.items():
        l = int(name[1:])
        out[l] = jnp.einsum("nuk,uw->nwk", x[l], w) / math.sqrt(w.shape[0])
    return out


def _spherical_harmonics(cfg: NequipConfig, vec):
    import e3nn_jax
    ls = list(range(cfg.filter_lmax + 1))
    y = e3nn_jax.spherical_harmonics(ls, e3nn_jax.IrrepsArray("1o", vec),
                                     normalize=cfg.normalize_sph,
                                     normalization="component").array
    out, start = {}, 0
    for l in ls:
        out[l] = y[:, start:start + 2 * l + 1]
        start += 2 * l + 1
    return out


def node_energies(params: dict, cfg: NequipConfig, vectors, senders, receivers, edge_mask,
                  element, node_mask=None):
    """Atomic energies (N,) in eV.

    Args:
      params: the pytree of :func:`param_shapes`.
      cfg: the architecture.
      vectors: (E, 3) edge vectors in Angstrom, pointing from the sender to
        the receiver (``R[receiver] - R[sender]``: chemtrain's and
        mace-torch's convention; sevenn's ``r_ij`` is its negative).
      senders, receivers: (E,) atom indices; receiver i sums the messages
        of its senders j.
      edge_mask: (E,) False for padded edges; edges at or beyond the cutoff
        are dropped here.
      element: (N,) model indices (``cfg.element_table()[Z]``), >= 0.
      node_mask: (N,) False for padded atoms (their energy is 0).
    """
    n = element.shape[0]
    # padded and self edges have zero vectors: no norm of them, so that no
    # NaN reaches the gradient through the masked branch
    nonzero = edge_mask & (jnp.sum(vectors ** 2, axis=-1) > 0)
    safe_vec = jnp.where(nonzero[:, None], -vectors,
                         jnp.array([0.0, 0.0, 1.0], vectors.dtype))
    r = jnp.linalg.norm(safe_vec, axis=-1)
    real = nonzero & (r < cfg.cutoff)
    safe_r = jnp.where(real, r, 1.0)
    basis = 2.0 / cfg.cutoff * jnp.sin(params["basis"] * safe_r[:, None]) / safe_r[:, None]
    edge_embedding = basis * (_cutoff(cfg, safe_r) * real)[:, None]
    sh = _spherical_harmonics(cfg, safe_vec)
    x = {0: (params["embedding"][element] / math.sqrt(cfg.num_elements))[:, :, None]}
    for t, layer in enumerate(params["layers"]):
        sc = _linear(layer["self_connection"], x)
        h = _linear(layer["linear_1"], x)
        hidden = edge_embedding
        for weight in layer["radial"][:-1]:
            hidden = act(hidden @ weight / math.sqrt(weight.shape[0]))
        last = layer["radial"][-1] / math.sqrt(layer["radial"][-1].shape[0])
        summed = messages(cfg, t, h, senders, sh, (hidden, last), receivers, n)
        y = _linear(layer["linear_2"], summed)
        y = {l: y[l] + sc[l] if l in sc else y[l] for l in y}
        x = _gate(cfg, t, y)
    hidden = x[0][:, :, 0] @ params["readout"][0] / math.sqrt(params["readout"][0].shape[0])
    e = (hidden @ params["readout"][1] / math.sqrt(params["readout"][1].shape[0]))[:, 0]
    e = params["scale"][element] * e + params["shift"][element]
    return e if node_mask is None else jnp.where(node_mask, e, 0.0)


def messages(cfg: NequipConfig, layer: int, h: dict, senders, sh: dict, radial: tuple,
             receivers, n: int) -> dict:
    """The summed messages of ``layer``: {l3: (n, multiplicity, 2 l3 + 1)}.

    ``h``: {l: (n, mul, 2l+1)} the atoms' features after ``linear_1``;
    ``senders``, ``receivers``: (E,) each edge's atoms; ``sh``: {l: (E,
    2l+1)} the edges' spherical harmonics; ``radial``: the radial MLP's last
    hidden layer (E, H) and its last weight (H, weights), already divided by
    the square root of H (one weight per path and channel, in
    :func:`conv_paths`' order).

    Every array of the edges' size is a plane (E, mul) of one component:
    each output component of a path is a sum of the senders' planes times
    scalars of the edge (spherical harmonics times Clebsch-Gordan
    coefficients), times the path's radial weights, which XLA fuses into
    elementwise loops over contiguous channels. A batched einsum per edge
    ((mul, 2l1+1) times (2l1+1, 2l3+1)) ran these as many tiny products: on
    2 CPU cores SevenNet-0's energy and forces took about twice as long
    (64-atom Si 121 -> 57 ms, 370-atom nanotube 1025 -> 541 ms). The cost is compiling
    about five times as many operations: the Si cell's energy and forces
    take 7.8 s to trace and compile (3.3 s before), a training step's
    gradient 20 s (6 s); the persistent cache limits that to a first run.
    """
    hidden, last = radial
    planes = {l1: [h[l1][:, :, a][senders] for a in range(2 * l1 + 1)]
              for l1 in sorted({p[0] for p in conv_paths(cfg, layer)})}
    parts: dict = {}
    col = 0
    for l1, l2, l3 in conv_paths(cfg, layer):
        mul = h[l1].shape[1]
        w = hidden @ last[:, col:col + mul]   # per path: no slice of an (E, weights) array
        col += mul
        cg = _cg(l1, l2, l3)
        out = []
        for k in range(2 * l3 + 1):
            total = None
            for a in range(2 * l1 + 1):
                filt = [float(cg[a, b, k]) * sh[l2][:, b] for b in range(2 * l2 + 1)
                        if abs(cg[a, b, k]) > 1e-12]
                if filt:
                    term = planes[l1][a] * sum(filt)[:, None]
                    total = term if total is None else total + term
            out.append(jnp.zeros_like(w) if total is None else total * w)
        parts.setdefault(l3, []).append(out)
    return {l3: jnp.stack([jax.ops.segment_sum(jnp.concatenate([p[k] for p in per_path], axis=1),
                                               receivers, n) for k in range(2 * l3 + 1)],
                          axis=-1) / cfg.denominators[layer]
            for l3, per_path in parts.items()}


def _gate(cfg: NequipConfig, layer: int, y: dict) -> dict:
    out = ls_of(cfg.irreps[layer + 1])
    scalars = out[0]
    x = {0: act(y[0][:, :scalars])}
    start = scalars
    for l in sorted(out):
        if l == 0:
            continue
        gates = act(y[0][:, start:start + out[l], 0])
        x[l] = y[l] * gates[:, :, None]
        start += out[l]
    return x

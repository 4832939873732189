"""Read mace-torch ``.model`` files (needs the ``mace-torch`` extra).

Every weight maps one to one onto :mod:`chemtrain.models.mace.model`, except
the symmetric contractions: mace-torch (e3nn path) contracts with its stored
basis tensors ``U_matrix_nu``, cuequivariance with its own basis. Both span
the same polynomials, so the converter finds the linear map between the two
weight sets by least squares on random inputs (for one channel) and refuses
the model if the map is not exact.

Opening the file (trust, importing torch and mace-torch) is in
:mod:`chemtrain.models.mace.torch_files`; its public names are re-exported here.
"""
from __future__ import annotations

import numpy as np

from chemtrain.models.mace import model as M
from chemtrain.models.mace.params import param_shapes
from chemtrain.models.mace.torch_files import (  # noqa: F401 - re-exported
    INSTALL_HINT, UNTRUSTED, UntrustedFileError, import_torch, read_torch_model)


class UnsupportedModelError(ValueError):
    """A MACE architecture that chemtrain and mace-torch cannot map onto each other.

    A ``ValueError``. :func:`load_mace_torch` raises it for a mace-torch model
    whose architecture chemtrain does not implement (chemtrain implements
    ``ScaleShiftMACE``/``MACE`` with ``RealAgnosticInteractionBlock`` and
    ``RealAgnosticResidualInteractionBlock``, Bessel radial basis, optional
    Agnesi transform and ZBL repulsion, one or several heads, e3nn layers);
    :func:`chemtrain.models.mace.export_mace_torch` raises it for a
    configuration that mace-torch's constructor cannot reproduce exactly.
    """



def _unsupported(what: str):
    raise UnsupportedModelError(
        f"Unsupported mace-torch architecture variant: {what}. chemtrain implements "
        f"ScaleShiftMACE/MACE with RealAgnosticInteractionBlock and "
        f"RealAgnosticResidualInteractionBlock, Bessel radial basis, optional Agnesi "
        f"transform and ZBL repulsion, e3nn (not cuEquivariance) layers.")


def _cls(m) -> str:
    return type(m).__name__


def config_from_torch(m) -> M.MaceConfig:
    """Architecture of a mace-torch model as a :class:`MaceConfig`."""
    name = _cls(m)
    if name not in ("ScaleShiftMACE", "MACE"):
        _unsupported(f"model class {name}")
    heads = tuple(str(h) for h in getattr(m, "heads", None) or M.DEFAULT_HEADS)
    if len(set(heads)) != len(heads):
        _unsupported(f"repeated head names {list(heads)}")
    for attr in ("joint_embedding", "embedding_readout"):
        if hasattr(m, attr):
            _unsupported(f"extra embeddings ({attr})")
    if getattr(m, "use_agnostic_product", False):
        _unsupported("use_agnostic_product=True")
    if getattr(m, "use_so3", False):
        _unsupported("use_so3=True")
    if getattr(m, "use_last_readout_only", False):
        _unsupported("use_last_readout_only=True")
    re = m.radial_embedding
    if _cls(re.bessel_fn) != "BesselBasis":
        _unsupported(f"radial basis {_cls(re.bessel_fn)}")
    if not getattr(re, "apply_cutoff", True):
        _unsupported("apply_cutoff=False")
    transform = None
    if hasattr(re, "distance_transform"):
        if _cls(re.distance_transform) != "AgnesiTransform":
            _unsupported(f"distance transform {_cls(re.distance_transform)}")
        transform = "Agnesi"
    if len(m.interactions) != len(m.products) or len(m.readouts) != len(m.interactions):
        _unsupported(f"{len(m.interactions)} interactions with {len(m.readouts)} readouts")

    act_constants = []
    layers = []
    for t, (inter, prod, read) in enumerate(zip(m.interactions, m.products, m.readouts)):
        iname = _cls(inter)
        if iname not in M.INTERACTIONS:
            _unsupported(f"interaction block {iname} (layer {t})")
        if hasattr(inter, "conv_fusion"):
            _unsupported("fused convolution (cuEquivariance/OpenEquivariance)")
        sc = prod.symmetric_contractions
        if _cls(sc) != "SymmetricContraction":
            _unsupported(f"symmetric contraction {_cls(sc)} (a cuEquivariance model? convert it "
                         f"back with mace's convert_cueq_e3nn first)")
        rname = _cls(read)
        if rname == "LinearReadoutBlock":
            readout = "linear"
        elif rname == "NonLinearReadoutBlock":
            readout = "nonlinear"
            acts = read.non_linearity.acts
            if len(acts) != 1 or getattr(acts[0], "f", None) is None:
                _unsupported("readout activation")
            _check_silu(acts[0].f)
            act_constants.append(float(acts[0].cst))
            if len(heads) > 1 and getattr(read, "num_heads", 1) != len(heads):
                _unsupported(f"a nonlinear readout that does not mask its {len(heads)} heads")
        else:
            _unsupported(f"readout block {rname}")
        for layer in inter.conv_tp_weights.children():
            if layer.act is not None:
                _check_silu(layer.act.f)
                act_constants.append(float(layer.act.cst))
        # models written by older mace-torch releases (MACE-MP-0 of 2023) have
        # no edge_irreps attribute: their edges carry the node irreps
        edge_irreps = getattr(inter, "edge_irreps", None) or inter.node_feats_irreps
        layers.append(M.Layer(
            interaction=iname,
            node_irreps=str(inter.node_feats_irreps),
            edge_irreps=str(edge_irreps),
            target_irreps=str(inter.target_irreps),
            hidden_irreps=str(prod.linear.irreps_out),
            correlation=int(sc.contractions[0].correlation),
            readout=readout,
        ))
        if str(edge_irreps) != str(inter.node_feats_irreps):
            _unsupported("edge_irreps different from the node features")
    if not np.allclose(act_constants, act_constants[0], rtol=1e-12, atol=0):
        _unsupported(f"different activation normalisations {act_constants}")
    mlp_irreps = "1x0e"
    for read in m.readouts:
        if _cls(read) == "NonLinearReadoutBlock":
            mlp_irreps = _per_head_mlp(str(read.hidden_irreps), len(heads))

    e0, scale, shift = _per_head_constants(m, name, heads)

    import ase.data
    kwargs = {}
    radii = np.asarray(ase.data.covalent_radii, np.float64)
    if transform == "Agnesi":
        t = re.distance_transform
        kwargs["agnesi"] = (float(t.q), float(t.p), float(t.a))
        radii = t.covalent_radii.detach().cpu().numpy().astype(np.float64)
    pair = hasattr(m, "pair_repulsion_fn")
    if pair:
        z = m.pair_repulsion_fn
        kwargs["zbl"] = (*[float(c) for c in z.c], float(z.a_exp), float(z.a_prefactor))
        radii = z.covalent_radii.detach().cpu().numpy().astype(np.float64)
        if int(z.p) != int(re.cutoff_fn.p):
            _unsupported("ZBL cutoff exponent different from the radial one")
    rmlp = [layer.weight.shape[1] for layer in list(m.interactions[0].conv_tp_weights.children())[:-1]]
    return M.MaceConfig(
        atomic_numbers=tuple(int(z) for z in m.atomic_numbers.cpu().numpy()),
        r_max=float(m.r_max),
        num_bessel=int(re.bessel_fn.bessel_weights.shape[0]),
        num_polynomial_cutoff=int(re.cutoff_fn.p),
        max_ell=int(m.spherical_harmonics.irreps_out.lmax),
        avg_num_neighbors=float(m.interactions[0].avg_num_neighbors),
        radial_mlp=tuple(rmlp),
        layers=tuple(layers),
        mlp_irreps=mlp_irreps,
        atomic_energies=e0, scale=scale, shift=shift, heads=heads,
        act_constant=act_constants[0],
        distance_transform=transform,
        pair_repulsion=pair,
        covalent_radii=tuple(float(r) for r in radii),
        **kwargs,
    )


def _per_head_mlp(hidden: str, n_heads: int) -> str:
    """A nonlinear readout's hidden irreps (``n_heads * MLP_irreps``) per head."""
    if n_heads == 1:
        return hidden
    blocks = M.irreps(hidden)
    if len(blocks) != 1 or blocks[0].mul % n_heads:
        _unsupported(f"readout hidden irreps {hidden} for {n_heads} heads")
    return f"{blocks[0].mul // n_heads}x{blocks[0].ir}"


def _per_head_constants(m, name: str, heads):
    """E0s, scale and shift as MaceConfig holds them: flat and numbers for
    one head, one row and one entry per head for several."""
    n = len(heads)
    e0 = np.asarray(m.atomic_energies_fn.atomic_energies.detach().cpu().numpy(), np.float64)
    e0 = e0.reshape(1, -1) if e0.ndim == 1 else e0
    if e0.ndim != 2 or e0.shape[0] != n:
        _unsupported(f"atomic energies of shape {e0.shape} for {n} heads {list(heads)}")
    if name == "ScaleShiftMACE":
        scale, shift = (np.asarray(t.detach().cpu().numpy(), np.float64).reshape(-1)
                        for t in (m.scale_shift.scale, m.scale_shift.shift))
        if scale.size != n or shift.size != n:
            # mace-torch indexes scale[head]: one per head, or it fails
            _unsupported(f"{scale.size} scale(s) and {shift.size} shift(s) for {n} heads")
    else:
        scale, shift = np.ones(n), np.zeros(n)
    if n == 1:
        return tuple(float(x) for x in e0[0]), float(scale[0]), float(shift[0])
    return (tuple(tuple(float(x) for x in row) for row in e0),
            tuple(float(x) for x in scale), tuple(float(x) for x in shift))


def _check_silu(f):
    import torch
    x = torch.linspace(-3, 3, 7, dtype=torch.float64)
    if not torch.allclose(f(x), torch.nn.functional.silu(x)):
        _unsupported(f"activation {getattr(f, '__name__', f)} (only SiLU)")


def _np(t):
    return t.detach().cpu().numpy()


def _split(flat_w, shapes):
    out, i = [], 0
    for s in shapes:
        size = int(np.prod(s))
        out.append(flat_w[i:i + size].reshape(s))
        i += size
    if i != flat_w.size:
        raise UnsupportedModelError(f"weight of size {flat_w.size} does not match the expected "
                                    f"layer layout ({i}); unsupported variant.")
    return out


def params_from_torch(m, cfg: M.MaceConfig, dtype=None):
    """The parameter pytree of a mace-torch model (numpy arrays)."""
    shapes = param_shapes(cfg)
    if dtype is None:
        dtype = _np(m.interactions[0].linear_up.weight).dtype
    sd = {k: _np(v).astype(np.float64) for k, v in m.state_dict().items()}
    params = {"embedding": sd["node_embedding.linear.weight"].reshape(shapes["embedding"]),
              "interactions": [], "products": [], "readouts": []}
    for t, layer in enumerate(cfg.layers):
        s = shapes["interactions"][t]
        pre = f"interactions.{t}."
        mlp = [sd[f"{pre}conv_tp_weights.layer{k}.weight"] for k in range(len(s["radial_mlp"]))]
        for w, shape in zip(mlp, s["radial_mlp"]):
            if w.shape != shape:
                raise UnsupportedModelError(f"{pre}conv_tp_weights: {w.shape} vs {shape}")
        params["interactions"].append({
            "linear_up": _split(sd[pre + "linear_up.weight"], s["linear_up"]),
            "radial_mlp": mlp,
            "linear": _split(sd[pre + "linear.weight"], s["linear"]),
            "skip_tp": _split(sd[pre + "skip_tp.weight"], s["skip_tp"]),
        })
        sp = shapes["products"][t]
        params["products"].append({
            "symmetric": _symmetric_weights(m.products[t].symmetric_contractions, layer, sp["symmetric"]),
            "linear": _split(sd[f"products.{t}.linear.weight"], sp["linear"]),
        })
        sr = shapes["readouts"][t]
        params["readouts"].append({k: _split(sd[f"readouts.{t}.{k}.weight"], v) for k, v in sr.items()})
    import jax
    return jax.tree_util.tree_map(lambda x: np.asarray(x, dtype), params)


def contraction_bases(sc, layer: M.Layer):
    """Both symmetric-contraction bases of one product block, evaluated on
    the same random single-channel inputs, so that for every input
    ``A_cue @ w_cue == A_mace @ w_mace`` when the weights describe one model.

    Returns ``(A_cue, A_mace, blocks, channels)``: the two design matrices
    (rows: inputs x outputs), the mace-torch blocks as ``(state-dict name,
    contraction index, nu, U)`` in column order, and the channel count.
    """
    channels = M.irreps(layer.target_irreps)[0].mul
    single_in = "+".join(f"1x{ir}" for _, ir in M.irreps(layer.target_irreps))
    single_out = "+".join(f"1x{ir}" for _, ir in M.irreps(layer.hidden_irreps))
    poly = M.symmetric_descriptor(single_in, single_out, layer.correlation)
    n_cue, d_in = poly.inputs[0].size, poly.inputs[1].size
    offsets = np.cumsum([0] + [ir.dim for _, ir in M.irreps(layer.hidden_irreps)])

    # mace: for each output irrep and degree nu, U (out, in^nu, K) and weights (Z, K, C)
    blocks = []
    for o, contraction in enumerate(sc.contractions):
        corr = contraction.correlation
        for nu in range(1, corr + 1):
            U = _np(getattr(contraction, f"U_matrix_{nu}")).astype(np.float64)
            U = U[None] if U.ndim == nu + 1 else U
            name = (f"contractions.{o}.weights_max" if nu == corr
                    else f"contractions.{o}.weights.{corr - 1 - nu}")
            blocks.append((name, o, nu, U))
    n_mace = sum(U.shape[-1] for *_, U in blocks)
    rng = np.random.default_rng(0)
    n_samples = max(8, 3 * (max(n_cue, n_mace) // offsets[-1] + 1))
    x = rng.normal(size=(n_samples, d_in))
    A_mace = np.zeros((n_samples, offsets[-1], n_mace))
    col = 0
    for _, o, nu, U in blocks:
        letters = "abcdefgh"[:nu]
        spec = f"M{letters}k," + ",".join(f"s{c}" for c in letters) + "->sMk"
        A_mace[:, offsets[o]:offsets[o + 1], col:col + U.shape[-1]] = np.einsum(spec, U, *([x] * nu))
        col += U.shape[-1]
    [A_cue] = poly(np.eye(n_cue)[None], x[:, None, :])     # (samples, n_cue, outputs)
    A_c = np.transpose(A_cue, (0, 2, 1)).reshape(-1, n_cue)
    return A_c, A_mace.reshape(-1, n_mace), blocks, channels


def _symmetric_weights(sc, layer: M.Layer, shape):
    """mace-torch symmetric-contraction weights -> cuequivariance weights
    (num_elements, paths * channels)."""
    A_c, A_m, blocks, channels = contraction_bases(sc, layer)
    state = dict(sc.named_parameters())
    weights = [_np(state[name]).astype(np.float64) for name, *_ in blocks]
    P, *_ = np.linalg.lstsq(A_c, A_m, rcond=None)
    err = np.linalg.norm(A_c @ P - A_m) / max(np.linalg.norm(A_m), 1e-300)
    if err > 1e-5:
        raise UnsupportedModelError(
            f"symmetric contraction basis could not be mapped onto cuequivariance's "
            f"(relative residual {err:.1e}); unsupported variant.")
    W = np.concatenate(weights, axis=1)                  # (Z, n_mace, C)
    cue_w = np.einsum("pk,zkc->zpc", P, W)                # (Z, n_cue, C)
    out = cue_w.reshape(cue_w.shape[0], -1)
    if out.shape != tuple(shape) or cue_w.shape[2] != channels:
        raise UnsupportedModelError(f"symmetric contraction weights {out.shape} vs {shape}")
    return out


def load_mace_torch(path: str, *, trusted: bool = False, dtype=None):
    """Read a mace-torch ``.model`` file as ``(config, params)``.

    A ``.model`` file is a pickled Python object, and unpickling runs code from
    the file: this function refuses unless you pass ``trusted=True`` for a file
    from a source you trust. torch's ``torch.load`` default (safe, weights
    only) is left as it was before the call, although importing mace-torch
    switches it off. Needs the ``mace-torch`` extra (torch and mace-torch).
    Save the result with :func:`chemtrain.models.mace.save` so that later runs
    need neither torch nor mace-torch, nor trust.

    Args:
      path: the mace-torch model file (what ``torch.save(model, path)``
        writes, e.g. a MACE-MP ``.model`` file).
      trusted: must be exactly ``True`` for the file to be read.
      dtype: dtype of the returned parameters; default: the precision of the
        model file.

    Returns:
      The pair ``(config, params)`` of the :class:`MaceConfig` (Angstrom, eV)
      and the parameter pytree of numpy arrays. A multi-head model gives a
      configuration of its heads (``config.heads`` is the model's ``heads``,
      in order, with each head's E0s, scale and shift) and readouts with one
      output per head.

    Raises:
      UntrustedFileError: unless ``trusted`` is True.
      ImportError: if torch or mace-torch is not installed (the message gives
        the install command).
      FileNotFoundError: if there is no file at ``path``.
      ValueError: if ``torch.load`` fails, or the file holds a state dict or
        something other than a mace-torch MACE model.
      UnsupportedModelError: if the model's architecture is not one chemtrain
        implements, or its weights cannot be mapped exactly.
    """
    m = read_torch_model(path, trusted=trusted)
    cfg = config_from_torch(m)
    return cfg, params_from_torch(m, cfg, dtype)

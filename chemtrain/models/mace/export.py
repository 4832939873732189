"""Write chemtrain MACE models back to mace-torch ``.model`` files (needs the
``mace-torch`` extra).

The model is built with mace-torch's own ``ScaleShiftMACE`` constructor from
the configuration's hyper-parameters, then its weights are filled in. Before
anything is written, the architecture mace-torch built is read back with the
importer (:func:`chemtrain.models.mace.torch_io.config_from_torch`) and
compared with the configuration field by field: a configuration the
constructor cannot reproduce is refused with :class:`UnsupportedModelError`
naming the field. Every trainable tensor of the built model must be filled.

All weights map one to one, except the symmetric contractions: the importer
maps mace-torch's ``U_matrix`` basis onto cuequivariance's by least squares;
here the inverse map (cuequivariance's basis expressed in mace-torch's) is
found the same way, and the export is refused unless it is exact to
round-off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import numpy as np

from chemtrain.models.mace import model as M
from chemtrain.models.mace.params import param_shapes
from chemtrain.models.mace.torch_files import import_torch
from chemtrain.models.mace.torch_io import (UnsupportedModelError, config_from_torch,
                                            contraction_bases)

log = logging.getLogger(__name__)

__all__ = ["export_mace_torch", "build_torch_model"]

# relative residual of the basis map above which a model is refused
BASIS_TOLERANCE = 1e-8


def export_mace_torch(cfg: M.MaceConfig, params, path: str, dtype=None,
                      overwrite: bool = False) -> str:
    """Write ``(cfg, params)`` as a mace-torch ``ScaleShiftMACE`` ``.model`` file.

    The file is what ``torch.save(model, path)`` writes in mace-torch (written
    atomically: a crash leaves no half-written file), so
    ``mace.calculators.MACECalculator(model_paths=path)`` loads it, and
    mace-torch's ``create_lammps_model`` converts it. A model of several heads
    is written as mace-torch's multi-head model (its ``heads`` are
    ``cfg.heads``, in order): pick one with
    ``MACECalculator(model_paths=path, head=name)``, or extract it with
    mace-torch's ``mace_select_head``. The model is built with
    mace-torch's own constructor, its architecture is compared with ``cfg``
    field by field, and every trainable tensor is filled. Needs the
    ``mace-torch`` extra.

    Args:
      cfg: the model configuration (Angstrom, eV).
      params: the parameter pytree of ``cfg``.
      path: the file to write.
      dtype: ``"float32"`` or ``"float64"``; default: float32 if every
        parameter is float32, else float64.
      overwrite: whether to replace an existing file at ``path``.

    Returns:
      ``path``.

    Raises:
      FileExistsError: if ``path`` exists and ``overwrite`` is False.
      ImportError: if torch or mace-torch is not installed (the message gives
        the install command).
      ValueError: if ``dtype`` is not float32 or float64, or ``params`` does not
        have the structure and shapes of ``cfg``'s parameters.
      UnsupportedModelError: if mace-torch's constructor cannot represent the
        configuration exactly (the message names the differing fields), if the
        built model's parameters do not match chemtrain's, or if the symmetric
        contractions cannot be mapped exactly onto mace-torch's basis.
    """
    import io
    import os
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{os.fspath(path)!r} exists; export_mace_torch does not write over "
                              f"it. Choose another path, or pass overwrite=True.")
    from chemtrain.checkpoint import atomic_write_bytes
    torch = import_torch()
    model = build_torch_model(cfg, params, dtype)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    atomic_write_bytes(str(path), buffer.getvalue())   # a crash leaves no half-written file
    log.info("wrote mace-torch ScaleShiftMACE to %s", path)
    return path


def build_torch_model(cfg: M.MaceConfig, params, dtype=None):
    """Build the mace-torch ``ScaleShiftMACE`` module of ``(cfg, params)``.

    Args:
      cfg: the model configuration (Angstrom, eV).
      params: the parameter pytree of ``cfg``.
      dtype: ``"float32"`` or ``"float64"``; default: float32 if every
        parameter is float32, else float64.

    Returns:
      The torch module, in eval mode.

    Raises:
      ImportError: if torch or mace-torch is not installed.
      ValueError: if ``dtype`` is not float32 or float64, or ``params`` does not
        have the structure and shapes of ``cfg``'s parameters.
      UnsupportedModelError: if mace-torch's constructor cannot represent the
        configuration exactly, or the weights cannot be mapped exactly.
    """
    torch = import_torch()
    leaves = _leaves(params)
    if dtype is None:
        dtype = "float32" if all(np.asarray(x).dtype == np.float32 for x in leaves) else "float64"
    try:
        dtype = np.dtype(dtype).name
    except TypeError:
        dtype = repr(dtype)
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype}.")
    _check_shapes(cfg, params)
    tdtype = getattr(torch, dtype)
    with _default_dtype(torch, tdtype), warnings.catch_warnings():
        # e3nn scripts its modules with TorchScript as they are built, and
        # TorchScript warns (about a dozen times) about e3nn's own
        # annotations: nothing about this model or the user's input
        warnings.filterwarnings("ignore", category=UserWarning,
                                message="The TorchScript type system doesn't support")
        model = _construct(cfg)
    _fill_buffers(model, cfg, torch)
    _compare_configs(cfg, config_from_torch(model), rtol=1e-6 if dtype == "float32" else 1e-12)
    _fill_weights(model, cfg, params, torch)
    return model.eval()


# --------------------------------------------------------------------------
# architecture

@contextlib.contextmanager
def _default_dtype(torch, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _construct(cfg: M.MaceConfig):
    from e3nn import o3
    from mace import modules
    layers = cfg.layers
    later = {layer.interaction for layer in layers[1:]}
    if len(later) > 1:
        raise UnsupportedModelError(
            f"Cannot export: mace-torch uses one interaction class for every layer after the "
            f"first, this model has {sorted(later)}.")
    hidden = layers[0].hidden_irreps
    keep_last = len(layers) > 1 and layers[-1].hidden_irreps == hidden and len(M.irreps(hidden)) > 1
    interaction = next(iter(later)) if later else layers[0].interaction
    import torch
    try:
        return modules.ScaleShiftMACE(
            r_max=float(cfg.r_max), num_bessel=cfg.num_bessel,
            num_polynomial_cutoff=cfg.num_polynomial_cutoff, max_ell=cfg.max_ell,
            interaction_cls=modules.interaction_classes[interaction],
            interaction_cls_first=modules.interaction_classes[layers[0].interaction],
            num_interactions=len(layers), num_elements=cfg.num_elements,
            hidden_irreps=o3.Irreps(hidden), MLP_irreps=o3.Irreps(cfg.mlp_irreps),
            atomic_energies=np.asarray(cfg.atomic_energies, np.float64),
            heads=[str(h) for h in cfg.heads],
            avg_num_neighbors=float(cfg.avg_num_neighbors),
            atomic_numbers=[int(z) for z in cfg.atomic_numbers],
            correlation=[int(layer.correlation) for layer in layers],
            gate=torch.nn.functional.silu, pair_repulsion=bool(cfg.pair_repulsion),
            distance_transform=cfg.distance_transform or "None",
            radial_MLP=[int(w) for w in cfg.radial_mlp], keep_last_layer_irreps=keep_last,
            atomic_inter_scale=_number_or_list(cfg.scale),
            atomic_inter_shift=_number_or_list(cfg.shift))
    except Exception as e:  # noqa: BLE001 - mace-torch asserts/raises many kinds
        raise UnsupportedModelError(
            f"Cannot export: mace-torch's ScaleShiftMACE constructor refused this configuration "
            f"({type(e).__name__}: {e}).") from e


def _number_or_list(x):
    """A per-head tuple as a list of floats (mace-torch's per-head scale or
    shift), a single head's number as a float."""
    return [float(v) for v in x] if isinstance(x, tuple) else float(x)


def _fill_buffers(model, cfg: M.MaceConfig, torch) -> None:
    """Constants the constructor takes from its defaults: the Agnesi and ZBL
    parameters and covalent radii."""
    def put(buf, value):
        with torch.no_grad():
            buf.copy_(torch.as_tensor(np.asarray(value, np.float64)).to(buf.dtype).reshape(buf.shape))

    radii = np.asarray(cfg.covalent_radii, np.float64)
    if cfg.distance_transform == "Agnesi":
        t = model.radial_embedding.distance_transform
        for name, value in zip(("q", "p", "a"), cfg.agnesi):
            put(getattr(t, name), value)
        _put_radii(t, radii, put)
    if cfg.pair_repulsion:
        z = model.pair_repulsion_fn
        put(z.c, cfg.zbl[:4])
        put(z.a_exp, cfg.zbl[4])
        put(z.a_prefactor, cfg.zbl[5])
        _put_radii(z, radii, put)


def _put_radii(module, radii, put):
    if radii.shape != tuple(module.covalent_radii.shape):
        raise UnsupportedModelError(
            f"Cannot export: the configuration has {radii.size} covalent radii, mace-torch "
            f"expects {module.covalent_radii.numel()} (one per element of ase.data).")
    put(module.covalent_radii, radii)


def _compare_configs(want: M.MaceConfig, got: M.MaceConfig, rtol: float) -> None:
    diffs = []

    def walk(a, b, where):
        if dataclasses.is_dataclass(a):
            for f in dataclasses.fields(a):
                walk(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}" if where else f.name)
        elif isinstance(a, (tuple, list)):
            if not isinstance(b, (tuple, list)) or len(a) != len(b):
                diffs.append(f"{where}: {a!r} (mace-torch would build {b!r})")
                return
            for k, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{k}]")
        elif isinstance(a, float) or isinstance(b, float):
            if not np.isclose(float(a), float(b), rtol=rtol, atol=0.0):
                diffs.append(f"{where}: {a!r} (mace-torch would build {b!r})")
        elif a != b:
            diffs.append(f"{where}: {a!r} (mace-torch would build {b!r})")

    walk(want, got, "")
    if diffs:
        raise UnsupportedModelError(
            "Cannot export exactly: mace-torch's ScaleShiftMACE constructor does not build this "
            "configuration; differences: " + "; ".join(diffs[:6])
            + (f" (and {len(diffs) - 6} more)" if len(diffs) > 6 else "")
            + ". Only configurations that mace-torch's constructor produces can be exported.")


# --------------------------------------------------------------------------
# weights

def _leaves(params):
    import jax
    return jax.tree_util.tree_leaves(params)


def _check_shapes(cfg: M.MaceConfig, params) -> None:
    import jax
    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    want, tree_w = jax.tree_util.tree_flatten(shapes, is_leaf=is_shape)
    got, tree_g = jax.tree_util.tree_flatten(params)
    if tree_w != tree_g:
        raise ValueError(f"params do not have the structure of this configuration's parameters "
                         f"(expected {tree_w}, got {tree_g}); pass the params that belong to cfg.")
    for k, (s, x) in enumerate(zip(want, got)):
        if tuple(np.shape(x)) != tuple(s):
            raise ValueError(f"parameter leaf {k} has shape {np.shape(x)}, the configuration "
                             f"needs {s}; pass the params that belong to cfg.")


def _flat(blocks):
    return np.concatenate([np.asarray(b, np.float64).reshape(-1) for b in blocks])


def _fill_weights(model, cfg: M.MaceConfig, params, torch) -> None:
    state = {"node_embedding.linear.weight": np.asarray(params["embedding"], np.float64).reshape(-1)}
    for t, layer in enumerate(cfg.layers):
        p = params["interactions"][t]
        pre = f"interactions.{t}."
        state[pre + "linear_up.weight"] = _flat(p["linear_up"])
        state[pre + "linear.weight"] = _flat(p["linear"])
        state[pre + "skip_tp.weight"] = _flat(p["skip_tp"])
        for k, w in enumerate(p["radial_mlp"]):
            state[f"{pre}conv_tp_weights.layer{k}.weight"] = np.asarray(w, np.float64)
        state[f"products.{t}.linear.weight"] = _flat(params["products"][t]["linear"])
        sc = model.products[t].symmetric_contractions
        for key, w in _symmetric_to_torch(sc, layer, params["products"][t]["symmetric"]).items():
            state[f"products.{t}.symmetric_contractions.{key}"] = w
        for k, w in params["readouts"][t].items():
            state[f"readouts.{t}.{k}.weight"] = _flat(w)

    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(state))
    extra = sorted(set(state) - set(named))
    if missing or extra:
        raise UnsupportedModelError(
            f"Cannot export: the mace-torch model's parameters do not match chemtrain's "
            f"(not filled: {missing}, unknown: {extra}).")
    with torch.no_grad():
        for name, value in state.items():
            target = named[name]
            if value.size != target.numel():
                raise UnsupportedModelError(f"Cannot export: {name} has {target.numel()} "
                                            f"entries in mace-torch, {value.size} in chemtrain.")
            # a copy: torch warns on arrays it cannot write to (e.g. read from an extxyz run)
            target.copy_(torch.as_tensor(np.array(value.reshape(tuple(target.shape)), copy=True))
                         .to(target.dtype))


def _symmetric_to_torch(sc, layer: M.Layer, cue_weights):
    """cuequivariance symmetric-contraction weights (num_elements,
    paths * channels) -> mace-torch's ``weights_max`` / ``weights`` tensors
    (state-dict names relative to the SymmetricContraction module)."""
    A_c, A_m, blocks, channels = contraction_bases(sc, layer)
    n_cue = A_c.shape[1]
    Q, *_ = np.linalg.lstsq(A_m, A_c, rcond=None)           # cue basis in mace's basis
    err = np.linalg.norm(A_m @ Q - A_c) / max(np.linalg.norm(A_c), 1e-300)
    if err > BASIS_TOLERANCE:
        raise UnsupportedModelError(
            f"Cannot export exactly: cuequivariance's symmetric-contraction basis is not "
            f"spanned by mace-torch's U matrices for {layer.target_irreps} -> "
            f"{layer.hidden_irreps}, correlation {layer.correlation} (relative residual "
            f"{err:.1e}).")
    cue = np.asarray(cue_weights, np.float64)
    cue = cue.reshape(cue.shape[0], n_cue, channels)
    W = np.einsum("kp,zpc->zkc", Q, cue)                   # (elements, n_mace, channels)
    out, col = {}, 0
    for name, _, _, U in blocks:
        out[name] = W[:, col:col + U.shape[-1], :]
        col += U.shape[-1]
    return out

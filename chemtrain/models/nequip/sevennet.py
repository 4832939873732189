"""SevenNet checkpoints (sevenn's ``.pth`` files) as a :class:`NequipConfig`
and its parameters.

A checkpoint is a torch pickle: :func:`load_sevennet` reads one only with
``trusted=True`` (the rule of mace-torch files). The published SevenNet-0
ships inside the ``sevenn`` package; :func:`resolve` finds it by name
without importing sevenn. Reading and writing need torch only: the
``sevennet`` extra installs torch and sevenn (sevenn needs e3nn >= 0.5,
mace-torch pins 0.4.4, so an environment with both installs sevenn with
``--no-deps``, for these files only).

What the loader converts, as sevenn's own loader does: the layer names of
checkpoints before 0.10, and, before 0.11, the radial MLP's output columns
(stored in e3nn's order of generation, used sorted by output l) and the
sign of the tensor-product paths whose stored Clebsch-Gordan buffer is the
negative of e3nn's. Architectures this model does not reproduce are refused
by name (:class:`UnsupportedSevenNetError`).
"""
from __future__ import annotations

import os
import re

import numpy as np

from chemtrain.models.mace.torch_io import UntrustedFileError
from chemtrain.models.nequip.model import (NequipConfig, _cg, conv_paths, generated_paths,
                                           ls_of, param_shapes)

INSTALL_HINT = ("SevenNet checkpoints are torch pickles and need PyTorch: pip install "
                "'chemtrain[sevennet]' (torch and sevenn, whose package holds SevenNet-0), or "
                "pip install torch.")


def import_torch():
    """The ``torch`` module, or an ImportError that says how to install it.
    Only torch: reading or writing a SevenNet checkpoint needs neither
    sevenn nor mace-torch."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return torch


#: names of the checkpoints in the sevenn package -> their file in it
PRETRAINED = {
    "sevennet-0": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "7net-0": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "sevennet-0_11jul2024": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "7net-0_11jul2024": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "sevennet-0_22may2024": "SevenNet_0__22May2024/checkpoint_sevennet_0.pth",
    "7net-0_22may2024": "SevenNet_0__22May2024/checkpoint_sevennet_0.pth",
    "sevennet-l3i5": "SevenNet_l3i5/checkpoint_l3i5.pth",
    "7net-l3i5": "SevenNet_l3i5/checkpoint_l3i5.pth",
}

UNTRUSTED = ("{path!r} was not read: a SevenNet checkpoint is a Python pickle, and loading it "
             "can run any code the file contains. Pass trusted=True only for a file from a "
             "source you trust (the sevenn package's own SevenNet-0, or your own training run).")


class UnsupportedSevenNetError(ValueError):
    """A SevenNet checkpoint whose architecture this model does not reproduce."""


def resolve(name_or_path: str) -> str:
    """The file of a checkpoint name (``'sevennet-0'``, ``'7net-0'``,
    ``'7net-0_22may2024'``, ``'7net-l3i5'``) in the installed sevenn
    package, or ``name_or_path`` itself when it is a file.

    Args:
      name_or_path: a file, or one of the names of :data:`PRETRAINED`
        (any case).

    Raises:
      FileNotFoundError: neither a file nor a known name, or sevenn is not
        installed (the message says how to install it).
    """
    if os.path.isfile(name_or_path):
        return name_or_path
    key = str(name_or_path).lower()
    if key not in PRETRAINED:
        raise FileNotFoundError(f"{name_or_path!r} is neither a file nor a SevenNet checkpoint "
                                f"name; names: {sorted(PRETRAINED)}.")
    import importlib.util
    spec = importlib.util.find_spec("sevenn")   # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name_or_path!r} is a checkpoint of the sevenn package, which "
                                f"is not installed: pip install --no-deps sevenn==0.13.0 (its "
                                f"files only; chemtrain does not import it).")
    path = os.path.join(list(spec.submodule_search_locations)[0], "pretrained_potentials",
                        PRETRAINED[key])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The installed sevenn package has no {PRETRAINED[key]} "
                                f"(looked for {path}).")
    return path


# sevenn < 0.10 named its modules with spaces
_OLD_NAMES = [(r"^EdgeEmbedding", "edge_embedding"),
              (r"^reducing nn input to hidden", "reduce_input_to_hidden"),
              (r"^reducing nn hidden to energy", "reduce_hidden_to_energy"),
              (r"^rescale atomic energy", "rescale_atomic_energy"),
              (r"^(\d+) self connection intro", r"\1_self_connection_intro"),
              (r"^(\d+) convolution", r"\1_convolution"),
              (r"^(\d+) self interaction 2", r"\1_self_interaction_2"),
              (r"^(\d+) equivariant gate", r"\1_equivariant_gate"),
              (r"denumerator", "denominator")]


def _version(config) -> tuple:
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", str(config.get("version", "")))
    if not found:
        raise UnsupportedSevenNetError(f"The checkpoint's config has no version 'X.Y.Z' (got "
                                       f"{config.get('version')!r}).")
    return tuple(int(v) for v in found.groups())


def _require(config, key, allowed, default=None):
    value = config.get(key, default)
    if value not in allowed:
        raise UnsupportedSevenNetError(
            f"The checkpoint has {key}={value!r}; chemtrain's NequIP reproduces "
            f"{key} in {allowed} only.")
    return value


def config_of(config: dict, state: dict) -> NequipConfig:
    """The :class:`NequipConfig` of a checkpoint's ``config`` and state,
    refusing options this model does not reproduce (by name)."""
    _require(config, "interaction_type", ("nequip",), "nequip")
    _require(config, "self_connection_type", ("linear",), "nequip")
    _require(config, "is_parity", (False,))
    _require(config, "use_bias_in_linear", (False,), False)
    _require(config, "readout_as_fcn", (False,), False)
    _require(config, "act_radial", ("silu",))
    for key in ("act_scalar", "act_gate"):
        if (config.get(key) or {}).get("e") != "silu":
            raise UnsupportedSevenNetError(f"The checkpoint has {key}={config.get(key)!r}; "
                                           f"chemtrain's NequIP reproduces {{'e': 'silu'}} only.")
    for key in ("use_modality", "use_modal_node_embedding", "use_modal_self_inter_intro",
                "use_modal_self_inter_outro", "use_modal_output_block"):
        _require(config, key, (False, None), False)
    radial = config.get("radial_basis") or {}
    if radial.get("radial_basis_name") != "bessel":
        raise UnsupportedSevenNetError(f"The checkpoint has radial_basis={radial!r}; chemtrain's "
                                       f"NequIP reproduces the Bessel basis only.")
    cut = config.get("cutoff_function") or {}
    kind = {"XPLOR": "xplor", "poly_cut": "poly"}.get(cut.get("cutoff_function_name"))
    if kind is None:
        raise UnsupportedSevenNetError(f"The checkpoint has cutoff_function={cut!r}; chemtrain's "
                                       f"NequIP reproduces XPLOR and poly_cut only.")
    if not config.get("irreps_manual"):
        raise UnsupportedSevenNetError("The checkpoint has no irreps_manual; chemtrain's NequIP "
                                       "reads the layers' irreps from it.")
    irreps = []
    for text in config["irreps_manual"]:
        layer = []
        for part in str(text).split("+"):
            m = re.fullmatch(r"\s*(\d+)x(\d+)e\s*", part)
            if not m:
                raise UnsupportedSevenNetError(f"The checkpoint's irreps {text!r} hold {part!r}; "
                                               f"chemtrain's NequIP reproduces even irreps "
                                               f"'<mul>x<l>e' only.")
            layer.append((int(m.group(1)), int(m.group(2))))
        irreps.append(tuple(layer))
    type_map = {int(z): int(i) for z, i in config["_type_map"].items()}
    atomic_numbers = tuple(z for z, _ in sorted(type_map.items(), key=lambda zi: zi[1]))
    n_layers = int(config["num_convolution_layer"])
    return NequipConfig(
        atomic_numbers=atomic_numbers, cutoff=float(config["cutoff"]), cutoff_function=kind,
        cutoff_on=float(cut.get("cutoff_on", 0.0)), poly_p=int(cut.get("poly_cut_p_value", 6)),
        n_basis=int(radial.get("bessel_basis_num", 8)), irreps=tuple(irreps),
        filter_lmax=int(config["lmax"]),
        radial_hidden=tuple(int(h) for h in config["weight_nn_hidden_neurons"]),
        denominators=tuple(float(np.asarray(state[f"{t}_convolution.denominator"]).reshape(-1)[0])
                           for t in range(n_layers)),
        # sevenn before 0.10 wrote no _normalize_sph: its loader then uses False
        normalize_sph=bool(config.get("_normalize_sph", _version(config) >= (0, 10, 0))))


def _blocks(flat, ls_in: dict, ls_out: dict) -> dict:
    """e3nn Linear weights (one flat vector, (mul_in, mul_out) blocks in the
    order of the input l) as {'l<l>': block}."""
    out, start = {}, 0
    for l in sorted(ls_in):
        if l in ls_out:
            size = ls_in[l] * ls_out[l]
            out[f"l{l}"] = flat[start:start + size].reshape(ls_in[l], ls_out[l])
            start += size
    if start != flat.size:
        raise UnsupportedSevenNetError(f"A linear's weights have {flat.size} numbers; its irreps "
                                       f"{ls_in} -> {ls_out} need {start}.")
    return out


def _stored_columns(cfg: NequipConfig, t: int, get) -> list:
    """(path, width, sign) of layer ``t``'s radial-MLP output columns as a
    checkpoint before sevenn 0.11 stores them: in e3nn's order of generation,
    a path negated where its stored Clebsch-Gordan buffer is the negative of
    e3nn's."""
    x, out = ls_of(cfg.irreps[t]), []
    for path in generated_paths(cfg, t):
        sign = 1.0
        if min(path) > 0:
            stored = get(f"{t}_convolution.convolution._compiled_main_left_right."
                         f"_w3j_{path[0]}_{path[1]}_{path[2]}")
            sign = float(np.sign(np.sum(stored * _cg(*path) / np.sqrt(2 * path[2] + 1))))
        out.append((path, x[path[0]], sign))
    return out


def _reorder(matrix, have: list, want: list):
    """``matrix``'s column blocks, laid out as ``have`` ((path, width, sign)
    in order), rearranged as ``want``; each block is multiplied by both
    signs (each is +-1, so this converts either way)."""
    blocks, start = {}, 0
    for path, width, sign in have:
        blocks[path] = (matrix[:, start:start + width], sign)
        start += width
    return np.concatenate([blocks[p][0] * blocks[p][1] * sign for p, _, sign in want], axis=1)


def params_of(cfg: NequipConfig, config: dict, state: dict, dtype=np.float64) -> dict:
    """The parameters of a checkpoint's state (numpy, ``dtype``)."""
    def get(key):
        if key not in state:
            raise UnsupportedSevenNetError(f"The checkpoint has no {key!r}.")
        return np.asarray(state[key], np.float64)

    old = _version(config) < (0, 11, 0)
    shapes = param_shapes(cfg)
    layers = []
    for t, shape in enumerate(shapes["layers"]):
        x = ls_of(cfg.irreps[t])
        sc, lin1, lin2 = (get(f"{t}_{name}.linear.weight") for name in (
            "self_connection_intro", "self_interaction_1", "self_interaction_2"))
        radial = [get(f"{t}_convolution.weight_nn.layer{k}.weight")
                  for k in range(len(shape["radial"]))]
        if old:   # columns in the order of generation, some paths of the opposite sign
            radial[-1] = _reorder(radial[-1], _stored_columns(cfg, t, get),
                                  [(p, x[p[0]], 1.0) for p in conv_paths(cfg, t)])
        layer = {"self_connection": _blocks(sc, x, {int(k[1:]): v[1] for k, v in
                                                    shape["self_connection"].items()}),
                 "linear_1": _blocks(lin1, x, x),
                 "radial": radial,
                 "linear_2": _blocks(lin2, {int(k[1:]): v[0] for k, v in shape["linear_2"].items()},
                                     {int(k[1:]): v[1] for k, v in shape["linear_2"].items()})}
        layers.append(layer)
    readout = [get("reduce_input_to_hidden.linear.weight").reshape(shapes["readout"][0]),
               get("reduce_hidden_to_energy.linear.weight").reshape(shapes["readout"][1])]
    params = {"basis": get("edge_embedding.basis_function.coeffs"),
              "embedding": get("onehot_to_feature_x.linear.weight").reshape(shapes["embedding"]),
              "layers": layers, "readout": readout,
              "scale": get("rescale_atomic_energy.scale"),
              "shift": get("rescale_atomic_energy.shift")}
    import jax
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(
            shapes, is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s))):
        if got.shape != tuple(want):
            raise UnsupportedSevenNetError(f"A parameter of the checkpoint has shape {got.shape}; "
                                           f"the architecture of its config needs {tuple(want)}.")
    return jax.tree.map(lambda a: np.asarray(a, dtype), params)


def _read(name_or_path: str, trusted) -> tuple:
    """``(path, config, state, keys)`` of a checkpoint: ``state`` by today's
    names (numpy), ``keys`` each name's key in the file."""
    path = resolve(name_or_path)
    if trusted is not True:
        raise UntrustedFileError(UNTRUSTED.format(path=path))
    torch = import_torch()
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if not (isinstance(checkpoint, dict) and "config" in checkpoint
            and "model_state_dict" in checkpoint):
        raise UnsupportedSevenNetError(f"{path!r} is not a SevenNet checkpoint (a dict with "
                                       f"'config' and 'model_state_dict').")
    config = dict(checkpoint["config"])
    state, keys = {}, {}
    for stored, value in checkpoint["model_state_dict"].items():
        key = stored
        if _version(config) < (0, 10, 0):
            for pattern, new in _OLD_NAMES:
                key = re.sub(pattern, new, key)
        state[key] = value.detach().cpu().numpy() if hasattr(value, "detach") else value
        keys[key] = stored
    return path, config, state, keys


def load_sevennet(name_or_path: str, *, trusted: bool = False, dtype=np.float64):
    """Read a SevenNet checkpoint: ``(NequipConfig, params)``.

    Args:
      name_or_path: a ``.pth`` file, or a name of the sevenn package's
        checkpoints (:func:`resolve`, e.g. ``'sevennet-0'``).
      trusted: must be exactly True: the file is a pickle.
      dtype: of the parameters (the file holds float32).

    Raises:
      UntrustedFileError: unless ``trusted`` is True.
      UnsupportedSevenNetError: an architecture or option this model does not
        reproduce (named), or weights that do not fit the config.
      FileNotFoundError: see :func:`resolve`.
    """
    _, config, state, _ = _read(name_or_path, trusted)
    cfg = config_of(config, state)
    return cfg, params_of(cfg, config, state, dtype)

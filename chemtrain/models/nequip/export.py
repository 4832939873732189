"""Fine-tuned NequIP parameters written back as a SevenNet checkpoint.

:func:`save_sevennet` writes a ``.pth`` that sevenn's own calculator
(``SevenNetCalculator(model=path)``) loads: the checkpoint the model was
fine-tuned from is the template. Its config and every buffer (the
Clebsch-Gordan tables, the output masks, the denominators) are kept; each
trainable weight is replaced, in the template's own layout and version, so
that sevenn's loader converts the file exactly as it converts the template
(for the bundled checkpoints, sevenn 0.9's names, column order and signs).
A model of another architecture than the template's is refused.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from chemtrain.models.nequip.model import conv_paths, ls_of, param_shapes
from chemtrain.models.nequip.sevennet import (_read, _reorder, _stored_columns, _version,
                                              config_of, import_torch)


def _flat(blocks: dict) -> np.ndarray:
    """e3nn's flat Linear weights of {'l<l>': block}: blocks by ascending l."""
    return np.concatenate([np.asarray(blocks[k]).reshape(-1)
                           for k in sorted(blocks, key=lambda k: int(k[1:]))])


def _check_architecture(params, cfg, template: str) -> None:
    want = param_shapes(cfg)
    is_shape = lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s)  # noqa: E731
    got_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want, is_leaf=is_shape)[0]
    got = {jax.tree_util.keystr(k): np.shape(v) for k, v in got_leaves}
    need = {jax.tree_util.keystr(k): tuple(v) for k, v in want_leaves}
    for name in sorted(set(got) | set(need)):
        if got.get(name) != need.get(name):
            raise ValueError(
                f"The parameters are not of the architecture of the template {template!r}: "
                f"params{name} has shape {got.get(name, 'none')}, the template needs "
                f"{need.get(name, 'none')}. Export a model fine-tuned from this checkpoint "
                f"(same elements, layers and widths), with it as the template.")


def save_sevennet(path: str, params, template: str, *, trusted: bool = False,
                  overwrite: bool = False) -> str:
    """Write ``params`` as a SevenNet checkpoint that sevenn loads.

    Args:
      path: the ``.pth`` file to write (written whole, then renamed, so a
        crash leaves no half file).
      params: NequIP parameters (:func:`load_sevennet`'s, fine-tuned).
      template: the checkpoint they were loaded from (a file or a name such
        as ``'sevennet-0'``); its config and buffers are kept.
      trusted: must be exactly True: the template is a pickle.
      overwrite: replace an existing ``path``.

    Returns:
      ``path``.

    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False.
      ValueError: ``params`` are not of the template's architecture (the
        first parameter that differs is named).
      UntrustedFileError, UnsupportedSevenNetError, FileNotFoundError: as
        :func:`load_sevennet` for the template.
    """
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path!r} exists; pass overwrite=True to replace it, or choose "
                              f"another file.")
    _, config, state, keys = _read(template, trusted)
    cfg = config_of(config, state)
    _check_architecture(params, cfg, template)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    new = {"edge_embedding.basis_function.coeffs": params["basis"],
           "onehot_to_feature_x.linear.weight": params["embedding"],
           "reduce_input_to_hidden.linear.weight": params["readout"][0],
           "reduce_hidden_to_energy.linear.weight": params["readout"][1],
           "rescale_atomic_energy.scale": params["scale"],
           "rescale_atomic_energy.shift": params["shift"]}
    old = _version(config) < (0, 11, 0)
    for t, layer in enumerate(params["layers"]):
        new[f"{t}_self_connection_intro.linear.weight"] = _flat(layer["self_connection"])
        new[f"{t}_self_interaction_1.linear.weight"] = _flat(layer["linear_1"])
        new[f"{t}_self_interaction_2.linear.weight"] = _flat(layer["linear_2"])
        radial = list(layer["radial"])
        if old:   # back to the order of generation and the stored signs
            x = ls_of(cfg.irreps[t])
            radial[-1] = _reorder(radial[-1], [(p, x[p[0]], 1.0) for p in conv_paths(cfg, t)],
                                  _stored_columns(cfg, t, state.__getitem__))
        for k, matrix in enumerate(radial):
            new[f"{t}_convolution.weight_nn.layer{k}.weight"] = matrix

    torch = import_torch()
    out = {}
    for name, value in state.items():
        if name in new:
            if np.size(new[name]) != np.size(value):
                raise ValueError(f"{name}: {np.size(new[name])} numbers for the template's "
                                 f"{np.size(value)}.")
            value = np.asarray(new[name], np.asarray(value).dtype).reshape(np.shape(value))
        out[keys[name]] = torch.from_numpy(np.array(value))
    missing = sorted(set(new) - set(state))
    if missing:
        raise ValueError(f"The template {template!r} has no {missing}.")
    config = dict(config)
    # the config's statistics agree with the weights (sevenn reads both)
    config["shift"] = [float(v) for v in params["shift"]]
    config["scale"] = [float(v) for v in params["scale"]]
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"config": config, "model_state_dict": out}, tmp)
    os.replace(tmp, path)
    return path

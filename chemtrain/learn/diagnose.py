"""Why a training step went non-finite, in words: run on the host after a
failed update (never inside one), so that the ``TrainingError`` names a
likely cause and its fix instead of only "lower the learning rate".

The best-known cause: jax-md's own ``smap.pair_neighbor_list`` energies
(``energy.lennard_jones_neighbor_list`` and friends) evaluate padded
neighbor-list entries at r = 0 and mask the result afterwards, so their
gradient with respect to the parameters is NaN on any list with padding,
even where the energy and forces are finite.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PADDED_LIST_NOTE = (
    "The energy's gradient with respect to the parameters is NaN on a neighbor list with "
    "padding (entries pointing at index N), while the energy itself is {energy}. This is what "
    "jax-md's own smap.pair_neighbor_list energies do (e.g. energy.lennard_jones_neighbor_list): "
    "padded pairs are evaluated at r = 0 and masked afterwards, and the NaN of their gradient "
    "survives the mask. Use chemtrain's pair templates (chemtrain.models.lennard_jones_template, "
    "pair_mlp_template, harmonic_bond_template), which mask padding before the square root, or "
    "guard r with jnp.where(real, r, 1.0) in your own energy.")


def all_finite(tree):
    """Whether every inexact leaf of ``tree`` is finite: a JAX bool for JAX
    arrays (traced inside a compiled function, e.g. the force-matching
    step), a numpy bool for host values (checked in their own precision);
    ``bool(all_finite(x))`` on either."""
    leaves = [x for x in jax.tree.leaves(tree) if np.issubdtype(
        x.dtype if hasattr(x, "dtype") else np.result_type(x), np.inexact)]
    if not any(isinstance(x, jax.Array) for x in leaves):
        return np.bool_(all(np.all(np.isfinite(x)) for x in leaves))
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves \
        else jnp.asarray(True)


def has_padding(neighbor, n_atoms: int) -> bool:
    """Whether a jax-md neighbor list holds padded entries (index ``n_atoms``)."""
    idx = getattr(neighbor, "idx", None)
    return idx is not None and bool(np.any(np.asarray(idx) >= n_atoms))


def energy_gradient_note(energy_fn_template, params, positions, neighbor,
                         **energy_kwargs) -> str | None:
    """A sentence on the energy's parameter gradient at one configuration
    when it is not finite (naming padded jax-md lists when that is the
    cause), else None. Errors of the evaluation itself give None: this only
    adds to a message."""
    def energy(p):
        return energy_fn_template(p)(positions, neighbor=neighbor, **energy_kwargs)
    if not all_finite(params):
        bad = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(params)
               if not np.all(np.isfinite(np.asarray(v)))]
        return (f"The parameters themselves are not finite (NaN or inf in {', '.join(bad[:5])}): "
                f"an earlier update made them so (a learning rate too high, or an optimizer or "
                f"schedule that gives NaN).")
    try:
        value, grad = jax.value_and_grad(energy)(jax.tree.map(jnp.asarray, params))
    except Exception:  # noqa: BLE001 - a diagnosis must not raise
        return None
    if all_finite(grad):
        return None
    shown = f"{float(value):.6g}" if np.isfinite(float(value)) else "not finite either"
    if has_padding(neighbor, np.shape(positions)[0]):
        return PADDED_LIST_NOTE.format(energy=shown)
    return (f"The energy's gradient with respect to the parameters is not finite at a stored "
            f"configuration (energy {shown}): check the potential at these parameters.")


def nonfinite_predictions_note(predictions, quantities) -> str | None:
    """A sentence naming the observables that are not finite, with the
    reason a quantity states for its NaN (``fn.nan_reason``), else None."""
    bad = [k for k, v in predictions.items() if not np.all(np.isfinite(np.asarray(v)))]
    if not bad:
        return None
    reasons = [getattr(quantities.get(k), "nan_reason", None) for k in bad]
    text = f"The prediction(s) {bad} are not finite"
    return text + ("".join(f"; {r}" for r in reasons if r) or
                   ": check those quantities on the stored snapshots") + "."

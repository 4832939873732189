"""What an error costs, per target: the elementwise loss of force matching.

A target's loss is a function ``(residual, reference) -> elementwise
loss`` of the prediction minus the reference (and the reference itself,
for losses that depend on it); :func:`squared` is the default, the mean
squared error. :class:`TargetLoss` adds, for energies, whether they are
compared per atom. ``ForceMatching(..., losses={"F": huber(0.5)})``
chooses one per target; ``chemtrain-finetune --loss`` builds mace-torch's
'weighted', 'huber' and 'universal' losses from them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np


def squared(residual, reference=None):
    """The squared error (the default: mean squared error per target).

    Args:
      residual: prediction minus reference.
      reference: unused.
    """
    return residual * residual


def huber(delta: float) -> Callable:
    """Huber's loss as torch's ``huber_loss`` (mace-torch's ``--loss huber``).

    ``r^2 / 2`` for ``|r| <= delta``, ``delta (|r| - delta / 2)`` beyond.

    Args:
      delta: the threshold, > 0, in the target's units.

    Returns:
      ``loss(residual, reference=None)``, elementwise.
    """
    delta = _positive(delta, "huber: delta")

    def loss(residual, reference=None):
        a = jnp.abs(residual)
        return jnp.where(a <= delta, 0.5 * residual * residual, delta * (a - 0.5 * delta))
    return loss


#: mace-torch's edges of the 'universal' loss, in eV/Angstrom
MACE_TORCH_EDGES_EV_PER_A = (100.0, 200.0, 300.0)


def conditional_huber(delta: float, edges: Sequence[float] | None = None,
                      factors: Sequence[float] = (1.0, 0.7, 0.4, 0.1)) -> Callable:
    """Huber's loss on force components whose threshold shrinks for atoms
    with large reference forces (mace-torch's 'universal' loss): an atom
    whose reference force norm lies below ``edges[0]`` gets ``delta x
    factors[0]``, between ``edges[0]`` and ``edges[1]`` ``delta x
    factors[1]``, and so on. ``delta`` and ``edges`` are in the forces'
    units. Needs forces of shape (..., 3).

    Args:
      delta: the threshold of atoms with small reference forces, > 0, in the
        forces' units.
      edges: increasing reference force norms where the threshold changes,
        in the forces' units. None: mace-torch's 100, 200 and 300 eV/Angstrom
        (:data:`MACE_TORCH_EDGES_EV_PER_A`) in kJ/mol/nm, chemtrain's force
        unit (x964.85), in which :class:`~chemtrain.trainers.ForceMatching`'s
        data hold forces. Forces in eV/Angstrom: pass ``edges=(100, 200,
        300)``.
      factors: the threshold's factor in each interval, one more than edges.

    Returns:
      ``loss(residual, reference)``, elementwise.
    """
    if edges is None:
        from chemtrain import units
        per = units.force_factor(units.EV_TO_KJ_PER_MOL, units.ANGSTROM_TO_NM)
        edges = tuple(e * per for e in MACE_TORCH_EDGES_EV_PER_A)
    delta = _positive(delta, "conditional_huber: delta")
    edges, factors = tuple(float(e) for e in edges), tuple(float(f) for f in factors)
    if len(factors) != len(edges) + 1 or list(edges) != sorted(edges):
        raise ValueError(f"conditional_huber: give increasing edges and one factor more than "
                         f"edges, got edges {edges} and factors {factors}.")

    def loss(residual, reference):
        norm = jnp.linalg.norm(reference, axis=-1, keepdims=True)
        d = delta * jnp.asarray(factors, residual.dtype)[jnp.searchsorted(
            jnp.asarray(edges, norm.dtype), norm, side="right")]
        a = jnp.abs(residual)
        return jnp.where(a <= d, 0.5 * residual * residual, d * (a - 0.5 * d))
    return loss


@dataclasses.dataclass(frozen=True)
class TargetLoss:
    """The loss of one target.

    Attributes:
      fn: ``(residual, reference) -> elementwise loss``.
      per_atom: energies only: compare energies per atom (the residual
        divided by the structure's number of real atoms) instead of totals.
    """
    fn: Callable = squared
    per_atom: bool = False


def check_losses(losses: Mapping | None, targets) -> dict:
    """``{target: TargetLoss}`` for every trained target.

    Args:
      losses: ``{target: function or TargetLoss}``; a bare function means
        ``TargetLoss(fn)``; targets left out get squared errors.
      targets: the trained targets.
    """
    out = {t: TargetLoss() for t in targets}
    for t, spec in dict(losses or {}).items():
        if t not in targets:
            raise ValueError(f"losses names {t!r}, which is not trained (gammas has "
                             f"{sorted(targets)}); give a loss for a trained target.")
        if callable(spec) and not isinstance(spec, TargetLoss):
            spec = TargetLoss(spec)
        if not isinstance(spec, TargetLoss):
            raise TypeError(f"losses[{t!r}] must be a function (residual, reference) -> "
                            f"elementwise loss or a TargetLoss, got {type(spec).__name__}.")
        if spec.per_atom and t != "U":
            raise ValueError(f"losses[{t!r}]: per_atom applies to energies ('U') only.")
        out[t] = spec
    return out


def _positive(value, what):
    if not (isinstance(value, (int, float, np.number)) and np.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0 in the target's units, got "
                         f"{value!r}.")
    return float(value)

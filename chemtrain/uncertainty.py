"""What a committee's spread is worth: active-learning selection and
calibration against actual errors.

- :func:`committee_forces`: a :class:`~chemtrain.calculator.CommitteeCalculator`
  evaluated on structures: mean forces, per-atom spread and per-structure
  scores.
- :func:`select`: the indices of the ``n`` most uncertain structures of a
  pool (the structures to label next).
- :func:`calibration`: does the spread predict the error? Spearman rank
  correlation of per-structure predicted and actual force errors, the
  fraction of force components whose error lies within 1, 2 and 3
  predicted standard deviations (a Gaussian gives 0.683, 0.954, 0.997),
  with an optional scale of the spread (:func:`fit_scale`, fitted on a
  validation set as upstream chemtrain's calibration does).
- :func:`plot_calibration`: actual against predicted error, log-log.

Units: ASE's (eV/Angstrom), as the calculator gives them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["committee_forces", "scores", "rank", "select", "calibration", "fit_scale",
           "plot_calibration", "as_frames", "SCORES"]

#: per-structure uncertainty scores :func:`select` can rank by
SCORES = ("forces_std", "forces_std_mean", "energy_std")


def _frames(pool, what: str = "pool") -> list:
    if isinstance(pool, str):
        import ase.io
        try:
            pool = ase.io.read(pool, index=":")
        except Exception as e:  # noqa: BLE001 - ASE raises many kinds for unreadable files
            raise ValueError(f"ASE cannot read the {what} {pool!r} ({type(e).__name__}: {e}).") \
                from e
    frames = list(pool)
    for i, atoms in enumerate(frames):
        positions = getattr(atoms, "positions", None)
        if positions is None or np.ndim(positions) != 2 or np.shape(positions)[0] == 0:
            raise ValueError(f"Structure {i} of the {what} has no positions (got "
                             f"{type(atoms).__name__}): give ase.Atoms with at least one atom, "
                             f"or a file ASE reads.")
    return frames


def committee_forces(committee, frames) -> list[dict]:
    """The committee's forces on each structure.

    Args:
      committee: a :class:`~chemtrain.calculator.CommitteeCalculator`.
      frames: ``ase.Atoms`` structures, or a path ASE reads.

    Returns:
      Per structure a dict: ``forces`` (atoms, 3) the mean, ``member_forces``
      (K, atoms, 3), ``forces_std`` (atoms,), ``energy_std`` (eV) and the
      scores of :data:`SCORES`: ``forces_std`` the largest atom's spread,
      ``forces_std_mean`` the mean over atoms, ``energy_std`` per atom.

    Raises:
      ValueError: a structure without positions, an unreadable file.
    """
    out = []
    for atoms in _frames(frames, "structures"):
        atoms = atoms.copy()
        atoms.calc = committee
        atoms.get_forces()
        r = committee.results
        out.append({"forces": r["forces"], "member_forces": r["member_forces"],
                    "forces_std": r["forces_std"], "energy_std": r["energy_std"],
                    "scores": {"forces_std": float(np.max(r["forces_std"])),
                               "forces_std_mean": float(np.mean(r["forces_std"])),
                               "energy_std": float(r["energy_std"]) / len(atoms)}})
    return out


def scores(committee, pool, by: str = "forces_std") -> np.ndarray:
    """Each structure's uncertainty score.

    Args:
      committee: a :class:`~chemtrain.calculator.CommitteeCalculator`.
      pool: ``ase.Atoms`` structures, or a path ASE reads.
      by: the score, one of :data:`SCORES` (see :func:`select`).

    Returns:
      One score per structure (eV/Å; ``energy_std``: eV per atom).

    Raises:
      ValueError: unknown ``by``, a structure without positions.
    """
    if by not in SCORES:
        raise ValueError(f"by must be one of {SCORES}, got {by!r}.")
    return np.array([r["scores"][by] for r in committee_forces(committee, pool)])


def _check_n(n, size: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= size:
        raise ValueError(f"n must be a whole number from 1 to the pool's size ({size}), "
                         f"got {n!r}.")


def rank(values, n: int) -> np.ndarray:
    """The indices of the ``n`` largest ``values``, largest first (ties: the
    lower index first).

    Args:
      values: the scores, one per structure.
      n: how many to pick.

    Returns:
      ``n`` indices into ``values``.

    Raises:
      ValueError: ``n`` is not a whole number from 1 to ``len(values)``.
    """
    _check_n(n, len(values))
    return np.argsort(-np.asarray(values), kind="stable")[:n]


def select(committee, pool, n: int, by: str = "forces_std") -> np.ndarray:
    """The indices of the ``n`` most uncertain structures of ``pool``.

    Args:
      committee: a :class:`~chemtrain.calculator.CommitteeCalculator`.
      pool: candidate ``ase.Atoms`` structures, or a path ASE reads.
      n: how many to pick, 1 <= n <= len(pool).
      by: the score (:data:`SCORES`): ``'forces_std'`` (the largest atom's
        force spread, default), ``'forces_std_mean'`` (the mean over atoms)
        or ``'energy_std'`` (energy spread per atom).

    Returns:
      ``n`` indices into ``pool``, most uncertain first (ties: lower index
      first).

    Raises:
      ValueError: unknown ``by``, ``n`` out of range, a structure without
        positions.
    """
    if by not in SCORES:
        raise ValueError(f"by must be one of {SCORES}, got {by!r}.")
    frames = _frames(pool)
    _check_n(n, len(frames))   # before the committee runs
    return rank(scores(committee, frames, by), n)


def _errors(predictions, reference_forces):
    if len(predictions) != len(reference_forces):
        raise ValueError(f"{len(predictions)} structures but {len(reference_forces)} reference "
                         f"force arrays.")
    comp_err, comp_std, rmse, spread = [], [], [], []
    for i, (p, f) in enumerate(zip(predictions, reference_forces)):
        f = np.asarray(f, np.float64)
        if f.shape != p["forces"].shape:
            raise ValueError(f"Structure {i}: reference forces of shape {f.shape}, the "
                             f"committee's {p['forces'].shape}.")
        err = p["forces"] - f
        std = np.asarray(p["member_forces"]).std(0)
        comp_err.append(np.abs(err).ravel())
        comp_std.append(std.ravel())
        rmse.append(np.sqrt(np.mean(err ** 2)))
        spread.append(np.sqrt(np.mean(std ** 2)))
    return (np.concatenate(comp_err), np.concatenate(comp_std), np.array(rmse),
            np.array(spread))


def fit_scale(predictions, reference_forces) -> float:
    """The factor ``s`` that makes ``s x`` the spread a calibrated standard
    deviation on these structures: ``sqrt(mean((error / spread)^2))`` over
    force components (fit it on a validation set).

    Args:
      predictions: :func:`committee_forces` of the structures.
      reference_forces: their reference forces, one (atoms, 3) array each.

    Returns:
      The scale factor.
    """
    err, std, _, _ = _errors(predictions, reference_forces)
    keep = std > 0
    return float(np.sqrt(np.mean((err[keep] / std[keep]) ** 2)))


def calibration(predictions, reference_forces, scale: float = 1.0) -> dict:
    """How well the committee's spread predicts its force errors.

    Args:
      predictions: :func:`committee_forces` of test structures.
      reference_forces: their reference forces, one (atoms, 3) array each.
      scale: factor applied to the spread (1: raw; :func:`fit_scale` of a
        validation set: calibrated).

    Returns:
      A dict: ``spearman``, the rank correlation over structures of the
      predicted force spread (RMS over components) and the actual force
      RMSE; ``within`` ``{1: f1, 2: f2, 3: f3}``, the fraction of force
      components whose error is at most k scaled standard deviations
      (Gaussian: 0.683, 0.954, 0.997); ``scale``; ``n_structures``;
      ``per_structure`` ``{"predicted": [...], "actual": [...]}`` in
      eV/Angstrom.
    """
    from scipy.stats import spearmanr
    err, std, rmse, spread = _errors(predictions, reference_forces)
    rho = float(spearmanr(spread, rmse).statistic) if len(rmse) > 1 else float("nan")
    return {"spearman": rho, "scale": float(scale), "n_structures": len(rmse),
            "within": {k: float(np.mean(err <= k * scale * std)) for k in (1, 2, 3)},
            "per_structure": {"predicted": (scale * spread).tolist(), "actual": rmse.tolist()}}


def plot_calibration(report: dict, path: str, title: str | None = None) -> None:
    """Actual force RMSE against the predicted spread per structure, log-log,
    with the line of equality, written to ``path``.

    Args:
      report: :func:`calibration`'s result.
      path: the image file (any format matplotlib writes).
      title: the plot's title (default: the Spearman correlation).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pred = np.asarray(report["per_structure"]["predicted"])
    act = np.asarray(report["per_structure"]["actual"])
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.loglog(pred, act, "o", ms=4, alpha=0.7)
    lo = max(min(pred.min(), act.min()) * 0.8, 1e-6)
    hi = max(pred.max(), act.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="actual = predicted")
    ax.set_xlabel(f"predicted force spread x {report['scale']:.3g} (eV/Å)")
    ax.set_ylabel("actual force RMSE (eV/Å)")
    ax.set_title(title or f"Spearman {report['spearman']:.2f}, "
                          f"within 1/2/3 std: {report['within'][1]:.2f}/"
                          f"{report['within'][2]:.2f}/{report['within'][3]:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_frames(pool: Sequence | str, what: str = "pool") -> list:
    """``pool`` as a list of ``ase.Atoms`` (read with ASE from a path),
    each checked to have positions (ValueError naming the first that has
    none)."""
    return _frames(pool, what)

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

from chemtrain import units

__all__ = ["committee_forces", "scores", "rank", "select", "calibration", "fit_scale",
           "miscalibration_area",
           "plot_calibration", "as_frames", "check_informative", "SCORES"]

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


def check_informative(score, by: str = "forces_std") -> None:
    """Refuse scores that cannot rank anything: every one zero (or not
    finite) means the members agree everywhere (one model given twice, or
    members that never trained apart), and a ranking would return the
    pool's first structures.

    Args:
      score: the per-structure scores (:func:`scores`).
      by: the score's name, for the message.

    Raises:
      ValueError: naming the fix.
    """
    score = np.asarray(score, np.float64)
    if not np.all(np.isfinite(score)):
        bad = np.nonzero(~np.isfinite(score))[0]
        raise ValueError(f"The committee's {by} is not finite on structure(s) "
                         f"{bad[:10].tolist()}: check those structures and the members.")
    if not np.any(score > 0):
        raise ValueError(f"The committee's members agree on every structure ({by} 0 on all "
                         f"{len(score)}): they are one model (a file given twice?) or members "
                         f"that never trained apart, and a ranking would only return the "
                         f"pool's first structures. Use members trained from different seeds "
                         f"or on bootstrap samples (chemtrain-finetune --ensemble_size K).")


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
        positions, scores that rank nothing (:func:`check_informative`).
    """
    if by not in SCORES:
        raise ValueError(f"by must be one of {SCORES}, got {by!r}.")
    frames = _frames(pool)
    _check_n(n, len(frames))   # before the committee runs
    score = scores(committee, frames, by)
    check_informative(score, by)
    return rank(score, n)


def _errors(predictions, reference_forces):
    from chemtrain.learn.ensemble import committee_spread
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
        std = committee_spread(np.asarray(p["member_forces"]))
        comp_err.append(np.abs(err).ravel())
        comp_std.append(std.ravel())
        rmse.append(np.sqrt(np.mean(err ** 2)))
        spread.append(np.sqrt(np.mean(std ** 2)))
    _check_units(predictions, reference_forces)
    return (np.concatenate(comp_err), np.concatenate(comp_std), np.array(rmse),
            np.array(spread))


#: eV/Angstrom -> kJ/mol/nm (chemtrain's Python units), about 964.85
_KJ_MOL_NM = units.force_factor(units.EV_TO_KJ_PER_MOL, units.ANGSTROM_TO_NM)


def _check_units(predictions, reference_forces) -> None:
    """Refuse reference forces that cannot be in eV/Angstrom: an RMS
    component above 10 eV/Angstrom that is also above 100 eV/Angstrom or 30
    times the committee's own (e.g. chemtrain's kJ/mol/nm, x964.85)."""
    ref = np.sqrt(np.mean(np.concatenate([np.ravel(f) for f in reference_forces]) ** 2))
    pred = np.sqrt(np.mean(np.concatenate([np.ravel(p["forces"]) for p in predictions]) ** 2))
    if ref > 10.0 and (ref > 100.0 or ref > 30.0 * pred):
        raise ValueError(
            f"The reference forces have an RMS component of {ref:.4g}, the committee's "
            f"{pred:.4g} eV/Angstrom: they are not in eV/Angstrom (the calculator's unit). "
            f"Forces in chemtrain's kJ/mol/nm (e.g. a dataset's 'F') must be divided by "
            f"{_KJ_MOL_NM:.2f} (chemtrain.units.force_factor(EV_TO_KJ_PER_MOL, "
            f"ANGSTROM_TO_NM)).")


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)) \
            or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (1: the raw spread; fit_scale(...) "
                         f"of a validation set: calibrated), got {scale!r}.")
    return float(scale)


def fit_scale(predictions, reference_forces) -> float:
    """The factor ``s`` that makes ``s x`` the spread a calibrated standard
    deviation on these structures: ``sqrt(mean((error / spread)^2))`` over
    force components (fit it on a validation set).

    Args:
      predictions: :func:`committee_forces` of the structures.
      reference_forces: their reference forces, one (atoms, 3) array each.

    Returns:
      The scale factor.

    Raises:
      ValueError: reference forces that are not in eV/Angstrom (e.g.
        kJ/mol/nm, see :func:`calibration`), or members that agree on every
        force component (no spread to scale).
    """
    err, std, _, _ = _errors(predictions, reference_forces)
    keep = std > 0
    if not keep.any():
        raise ValueError("The committee's members agree on every force component (spread 0): "
                         "there is no spread to scale. Use members trained apart (different "
                         "seeds or bootstrap samples).")
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
      (Gaussian: 0.683, 0.954, 0.997); ``miscalibration_area``, the
      area between the fraction of components within each central
      Gaussian interval and that interval's probability, over all
      probabilities (0: calibrated; 0.5 at most); ``scale``; ``n_structures``;
      ``per_structure`` ``{"predicted": [...], "actual": [...]}`` in
      eV/Angstrom.

    Raises:
      ValueError: a ``scale`` that is not a finite number > 0; reference
        forces of another shape, or not in eV/Angstrom: an RMS component
        above 10 eV/Angstrom and above 100 eV/Angstrom or 30 times the
        committee's (chemtrain's kJ/mol/nm must be divided by 964.85).
    """
    from scipy.stats import spearmanr
    scale = _check_scale(scale)
    err, std, rmse, spread = _errors(predictions, reference_forces)
    rho = float(spearmanr(spread, rmse).statistic) if len(rmse) > 1 else float("nan")
    return {"spearman": rho, "scale": float(scale), "n_structures": len(rmse),
            "within": {k: float(np.mean(err <= k * scale * std)) for k in (1, 2, 3)},
            "miscalibration_area": miscalibration_area(err, scale * std),
            "per_structure": {"predicted": (scale * spread).tolist(), "actual": rmse.tolist()}}


def miscalibration_area(errors, std, points: int = 1000) -> float:
    """The area between the observed and the expected coverage: for each
    probability p, the fraction of ``|errors|`` within the central Gaussian
    interval of probability p (``z_p std``, ``z_p = sqrt(2) erfinv(p)``)
    against p itself, integrated over p in (0, 1) by the midpoint rule.
    0 for errors drawn from the predicted Gaussians; 0.5 when every error is
    far outside (or inside) its interval."""
    from scipy.special import erfinv
    errors, std = np.abs(np.ravel(errors)), np.ravel(std)
    p = (np.arange(points) + 0.5) / points
    z = np.sqrt(2.0) * erfinv(p)
    ratio = np.sort(np.where(std > 0, errors / np.where(std > 0, std, 1.0), np.inf))
    observed = np.searchsorted(ratio, z, side="right") / len(ratio)
    return float(np.mean(np.abs(observed - p)))


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

"""Test-set errors in the units chemists quote (energy per atom in eV, force
components in eV/Angstrom, stress in eV/Angstrom^3) and the parity plot."""
from __future__ import annotations

import numpy as np

from .data import ENERGY, FORCE, STRESS

UNITS = {"energy_eV_per_atom": "eV/atom", "force_eV_per_A": "eV/Å", "stress_eV_per_A3": "eV/Å³"}


def errors(pred: dict, ref: dict) -> dict:
    """Per-quantity error arrays: energy per atom, real atoms' force
    components, stress components of structures that have a stress label."""
    mask = ref["mask"].astype(bool)
    out = {}
    if "U" in ref:
        out["energy_eV_per_atom"] = (pred["U"] - ref["U"]) / ENERGY / mask.sum(1)
    if "F" in ref:
        out["force_eV_per_A"] = ((pred["F"] - ref["F"]) / FORCE)[mask].ravel()
    if "stress" in ref and "stress" in pred:
        has = ref.get("stress_weight", np.ones(len(ref["R"]))) > 0
        out["stress_eV_per_A3"] = ((pred["stress"] - ref["stress"]) / STRESS)[has].ravel()
    return out


def references(ref: dict) -> dict:
    zero = {k: 0 * v for k, v in ref.items() if k in ("U", "F", "stress")}
    return {k: -v for k, v in errors(zero, ref).items()}


def summary(pred: dict, ref: dict) -> dict:
    return {k: {"MAE": float(np.abs(e).mean()), "RMSE": float(np.sqrt((e ** 2).mean()))}
            for k, e in errors(pred, ref).items() if e.size}


def line(name: str, s: dict) -> str:
    parts = [f"{k.split('_')[0]} MAE {v['MAE']:.5g} RMSE {v['RMSE']:.5g} {UNITS[k]}"
             for k, v in s.items()]
    return f"Test errors, {name}: " + "; ".join(parts)


def parity_plot(path: str, ref: dict, curves: dict, title: str) -> None:
    """Prediction against reference per quantity, one colour per model, with
    MAE and RMSE in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    first = errors(next(iter(curves.values())), ref)
    refs = {k: v for k, v in references(ref).items() if v.size and k in first}
    fig, axes = plt.subplots(1, len(refs), figsize=(5 * len(refs), 4.6), squeeze=False)
    for (label, pred), colour in zip(curves.items(), ("#aaaaaa", "#1f77b4", "#d62728")):
        s = summary(pred, ref)
        err = errors(pred, ref)
        for ax, (key, x) in zip(axes[0], refs.items()):
            ax.scatter(x, x + err[key], s=6 if key.startswith("energy") else 1, alpha=0.6,
                       color=colour, label=f"{label}: MAE {s[key]['MAE']:.4g}, RMSE "
                                           f"{s[key]['RMSE']:.4g} {UNITS[key]}")
    for ax, (key, x) in zip(axes[0], refs.items()):
        lo, hi = ax.get_ylim()
        lo, hi = min(lo, x.min()), max(hi, x.max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        what = key.split("_")[0]
        ax.set_xlabel(f"reference {what} ({UNITS[key]})")
        ax.set_ylabel(f"predicted {what} ({UNITS[key]})")
        ax.legend(loc="upper left", fontsize=8, markerscale=4)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

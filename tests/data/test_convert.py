"""The dataset converter (chemtrain.data.convert, chemtrain-convert): stresses
and precomputed graphs written for the trainer, never overwriting a file or
writing over its input, validating atomic numbers, per-structure species,
periodicity per frame, and no partial output."""
from __future__ import annotations

import os
import re

import h5py
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cells_ref import LJ_GRAPHS, RC, brute_edges, lj_crystals, lj_molecules
from chemtrain import neighbors as nb
from chemtrain.data.convert import ConversionError, convert
from chemtrain.trainers import ForceMatching, RunOptions
from fresh_python import run_py


# ------------------------------------------------- stresses and graphs

def test_converter_reads_stress_and_writes_graphs(tmp_path):
    import ase
    import ase.io
    import h5py
    from ase.calculators.singlepoint import SinglePointCalculator
    from chemtrain.data import HDF5ParallelDataLoader
    from chemtrain.data.convert import convert
    frames = []
    for pos, cell, pbc in lj_crystals(2, seed=4) + lj_molecules(1, seed=5):
        atoms = ase.Atoms("Ar" * len(pos), positions=pos, cell=cell, pbc=pbc)
        results = {"energy": -0.1, "forces": np.full((len(pos), 3), 0.01)}
        if all(pbc):
            results["stress"] = np.array([1e-3, 2e-3, 3e-3, 4e-4, 5e-4, 6e-4])   # Voigt, eV/A^3
        atoms.calc = SinglePointCalculator(atoms, **results)
        frames.append(atoms)
    src = str(tmp_path / "frames.extxyz")
    ase.io.write(src, frames)
    out = str(tmp_path / "frames.h5")
    convert(src, out, graph_cutoff=RC * 0.1, progress=False)
    with h5py.File(out, "r") as f:
        stress, weight = f["stress"][()], f["stress_weight"][()]
        graphs = {k: f[k][()] for k in nb.GRAPH_KEYS}
        R, box, mask = f["R"][()], f["box"][()], f["mask"][()]
        assert f.attrs["stress_unit"] == "kJ/mol/nm^3"
    voigt = np.array([[1e-3, 6e-4, 5e-4], [6e-4, 2e-3, 4e-4], [5e-4, 4e-4, 3e-3]])
    np.testing.assert_allclose(stress[:2], np.stack([voigt] * 2) * 96485.33212, rtol=1e-9)
    assert (stress[2] == 0).all() and weight.tolist() == [1.0, 1.0, 0.0]
    for k in range(3):   # the edges of the positions and cells in the file
        pos, cell = R[k][mask[k]] * 10, box[k].T * 10
        pbc = [bool(cell.any())] * 3
        s, r, S = (graphs[key][k] for key in nb.GRAPH_KEYS)
        real = s < R.shape[1]
        got = {(int(a), int(b), tuple(int(x) for x in v)) for a, b, v in zip(s[real], r[real], S[real])}
        assert got == brute_edges(pos, cell, pbc, RC)
    # the trainer reads it with nbrs_init=None and asks for the stress weights
    tr = ForceMatching({"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(1.0)}, optax.sgd(0.0),
                       LJ_GRAPHS, None, batch=3, parallelism="single",
                       gammas={"U": 1.0, "stress": 1.0}, checkpoint_path=str(tmp_path / "c"),
                       options=RunOptions(progress=False))
    with pytest.raises(ValueError, match="stress_weight"):
        tr.set_loader(HDF5ParallelDataLoader(out), "testing")
    tr = ForceMatching({"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(1.0)}, optax.sgd(0.0),
                       LJ_GRAPHS, None, batch=3, parallelism="single",
                       gammas={"U": 1.0, "stress": 1.0}, weights_keys={"stress": "stress_weight"},
                       checkpoint_path=str(tmp_path / "c"), options=RunOptions(progress=False))
    tr.set_loader(HDF5ParallelDataLoader(out, keys=["R", "U", "F", "box", "mask", "stress",
                                                    "stress_weight", *nb.GRAPH_KEYS]), "testing")
    metrics = tr.evaluate("testing")
    assert np.isfinite(metrics["loss"]) and metrics["stress"]["MAE"] > 0


# ------------------------------------- files left intact, input validated

def md22_like(path, n=5, atoms=4, seed=0, **override):
    rng = np.random.default_rng(seed)
    arrays = dict(R=rng.normal(size=(n, atoms, 3)) * 3, F=rng.normal(size=(n, atoms, 3)),
                  E=rng.normal(size=n) * 10, z=np.array([6, 1, 1, 8][:atoms]))
    arrays.update(override)
    np.savez(path, **arrays)
    return str(path), arrays


def cli(*args, **kw):
    return run_py("import sys; from chemtrain.data.convert import main; "
                  f"sys.exit(main({list(map(str, args))!r}))", **kw)


def test_converter_never_destroys_a_file(tmp_path):
    src, _ = md22_like(tmp_path / "a.npz")
    src_bytes = open(src, "rb").read()
    out = tmp_path / "out.h5"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=r"out\.h5' exists; it was left untouched.*--overwrite"):
        convert(src, str(out), progress=False)
    assert out.read_bytes() == b"precious"
    convert(src, str(out), progress=False, overwrite=True)
    with h5py.File(out, "r") as f:
        assert f["R"].shape == (5, 4, 3)
    # the input itself, under several spellings, even with overwrite
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.npz")
    for target in (src, str(tmp_path / "sub" / ".." / "a.npz"), str(tmp_path / "link.npz")):
        with pytest.raises(ConversionError, match="is the input file itself"):
            convert(src, target, progress=False, overwrite=True)
    assert open(src, "rb").read() == src_bytes
    # the command line: `convert a.npz a.npz` exits non-zero with one line, input intact
    res = cli(src, src)
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("chemtrain-convert: error: ")
    assert "is the input file itself" in res.stderr
    assert open(src, "rb").read() == src_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "link.npz", "out.h5", "sub"]


def test_failed_conversion_leaves_no_partial_output(tmp_path):
    rng = np.random.default_rng(0)
    src, _ = md22_like(tmp_path / "big.npz", n=400, atoms=50,
                       z=rng.integers(1, 9, 50))  # about 1 MB of output
    out = tmp_path / "out.h5"
    out.write_bytes(b"precious")
    # the disk "fills up" (file-size limit) in the middle of writing
    res = run_py("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))\n"
                 "from chemtrain.data.convert import main\n"
                 f"sys.exit(main([{src!r}, {str(out)!r}, '--overwrite', '--chunk', '16']))")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.rstrip("\n").split("\n")[-1]  # after the progress bar
    assert re.fullmatch(r"chemtrain-convert: error: \[Errno 27\] Writing '.*out\.h5' failed \(File too large\); "
                        r"the partial output was removed and no existing file was changed\.", last), last
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.npz", "out.h5"]


@pytest.mark.parametrize("z,pattern", [
    (np.array([6, 1, 1]), r"'z' must hold one atomic number per atom, shape \(4,\) or \(5, 4\).*got \(3,\)"),
    (np.array([6, 1, 1, 8, 1]), r"got \(5,\)"),
    (np.ones((4, 4), int), r"got \(4, 4\)"),
    (np.array([6.5, 1, 1, 8]), r"non-integer atomic numbers \[6.5\]"),
    (np.array([6, 0, 1, 8]), r"holds \[0\], not atomic numbers"),
    (np.array(["C", "H", "H", "O"]), r"must hold atomic numbers, got dtype"),
])
def test_converter_validates_atomic_numbers(tmp_path, z, pattern):
    src, _ = md22_like(tmp_path / "a.npz", z=z)
    with pytest.raises(ConversionError, match=pattern):
        convert(src, str(tmp_path / "o.h5"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]


def test_converter_per_structure_z_and_whole_number_floats(tmp_path):
    z = np.array([[6, 1, 1, 8], [7, 1, 1, 1], [6, 6, 1, 1], [8, 1, 1, 6], [1, 1, 1, 1]])
    src, arrays = md22_like(tmp_path / "a.npz", z=z.astype(np.float64))
    convert(src, str(tmp_path / "o.h5"), n_atoms=6, chunk=2, progress=False)
    with h5py.File(tmp_path / "o.h5", "r") as f:
        np.testing.assert_array_equal(f["species"][:, :4], z)
        assert f["species"].dtype == np.int32 and (f["species"][:, 4:] == 0).all()
        np.testing.assert_allclose(f["F"][:, :4], arrays["F"] * 4.184 / 0.1)
        np.testing.assert_allclose(f["U"][:], arrays["E"] * 4.184)
        assert f["mask"][:].sum(1).tolist() == [4] * 5


def test_converter_keeps_box_per_frame_when_periodicity_varies(tmp_path):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    import ase.io
    rng = np.random.default_rng(1)
    cells = [np.array([[10.0, 0, 0], [1.0, 9.0, 0], [0.5, 0.3, 8.0]]), np.zeros((3, 3)),
             np.diag([7.0, 8.0, 9.0])]
    pbcs = [True, False, [True, True, False]]
    images = []
    for i, (cell, pbc) in enumerate(zip(cells, pbcs)):
        a = Atoms("C" * (3 + i), positions=rng.uniform(0, 5, (3 + i, 3)), cell=cell, pbc=pbc)
        a.calc = SinglePointCalculator(a, energy=float(i), forces=rng.normal(size=(3 + i, 3)))
        images.append(a)
    ase.io.write(tmp_path / "x.extxyz", images)
    images = ase.io.read(tmp_path / "x.extxyz", ":")  # as stored (text precision)
    convert(str(tmp_path / "x.extxyz"), str(tmp_path / "x.h5"), chunk=2, progress=False)
    with h5py.File(tmp_path / "x.h5", "r") as f:
        assert f["box"].shape == (3, 3, 3) and f["pbc"].shape == (3, 3)
        # jax-md convention: columns are the cell vectors (ASE's cell.T), in nm
        for i in (0, 2):
            np.testing.assert_allclose(f["box"][i], cells[i].T * 0.1, atol=1e-9)
        assert (f["box"][1] == 0).all()
        assert f["pbc"][:].tolist() == [[True] * 3, [False] * 3, [True, True, False]]
        frac = np.linalg.solve(f["box"][0], f["R"][0, :3].T).T  # box @ frac = position
        np.testing.assert_allclose(frac @ cells[0] * 0.1, images[0].positions * 0.1, atol=1e-9)

"""Reliability of the data side: no silently wrong shapes, no file destroyed,
every damaged file named.

Target shapes (in memory and in HDF5 files), negative weights, the ranks'
agreement on an HDF5 file, checkpoints damaged in every way (every single
flipped byte, every truncation, headers without fields, killed writes), the
converter (never overwriting, never writing over its input, validating atomic
numbers, periodicity per frame, no partial output), MACE model files with
configurations that do not fit their parameters, and pickled mace-torch files
that are read only with consent, leaving torch's safe default as it was.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import mp
from chemtrain import checkpoint
from chemtrain.checkpoint import CheckpointError, CheckpointNotFoundError
from chemtrain.data import HDF5ParallelDataLoader, validate_dataset
from chemtrain.data.convert import ConversionError, convert
from chemtrain.parallel import make_strategy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NO_SAFE_LOAD = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def small_data(n=6, atoms=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"R": rng.normal(size=(n, atoms, 3)), "U": rng.normal(size=n),
            "F": rng.normal(size=(n, atoms, 3)), "w": np.ones(n)}


def write_h5(path, data):
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
    return str(path)


def run_py(code, timeout=300, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != NO_SAFE_LOAD}
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.path.join(HERE, "_support")]), **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


# ---------------------------------------------------------------- target shapes

SHAPE_CASES = [  # (key, bad value maker, message pattern)
    ("U", lambda d: d["U"][:, None], r"\['U'\] must have shape \(structures,\) = \(6,\).*got \(6, 1\)"
                                     r".*\(n, n\) error.*reshape\(-1\)"),
    ("U", lambda d: np.zeros((6, 2)), r"\['U'\] must have shape \(structures,\).*got \(6, 2\)"),
    ("F", lambda d: d["F"][:, :1], r"\['F'\] must have shape \(structures, atoms, 3\) = \(6, 4, 3\)"
                                   r".*got \(6, 1, 3\).*atom 0's force copied to all"),
    ("F", lambda d: d["F"].reshape(6, 12), r"\['F'\].*got \(6, 12\).*reshape\(-1, 4, 3\)"),
    ("R", lambda d: d["R"][..., :2], r"\['R'\] must have shape \(structures, atoms, 3\), got \(6, 4, 2\)"),
    ("w", lambda d: d["w"][:, None], r"\['w'\] must have shape \(structures,\).*got \(6, 1\)"),
]


@pytest.mark.parametrize("key,bad,pattern", SHAPE_CASES)
def test_target_shapes_in_memory(key, bad, pattern):
    data = small_data()
    validate_dataset(data, ("R", "U", "F"), weights=("w",))  # the good one passes
    data[key] = bad(data)
    with pytest.raises(ValueError, match=pattern):
        validate_dataset(data, ("R", "U", "F"), weights=("w",))


def test_negative_and_nan_weights_in_memory():
    data = small_data()
    data["w"][[1, 4]] = -0.5
    with pytest.raises(ValueError, match=r"\['w'\] holds 2 negative weight\(s\), in structure\(s\) "
                                         r"\[1, 4\].*-0.5.*>= 0"):
        validate_dataset(data, weights=("w",))
    data["w"][[1, 4]] = [np.nan, 1.0]
    with pytest.raises(ValueError, match=r"\['w'\] holds 1 NaN or inf weight\(s\), in structure\(s\) \[1\]"):
        validate_dataset(data, weights=("w",))
    validate_dataset(data)  # not named as weights: not checked as weights


def _configure(path, **kw):
    loader = HDF5ParallelDataLoader(str(path))
    loader.configure(2, training=True, seed=0, strategy=make_strategy("single"),
                     required=("R", "U", "F"), **kw)
    return loader


@pytest.mark.parametrize("key,bad,pattern", SHAPE_CASES)
def test_target_shapes_in_hdf5(tmp_path, key, bad, pattern):
    data = small_data()
    _configure(write_h5(tmp_path / "good.h5", data), weights=("w",))
    data[key] = bad(data)
    path = write_h5(tmp_path / "bad.h5", data)
    file_pattern = pattern.replace(r"reshape\(-1\)", r"rewrite the dataset 'U' with shape \(6,\)")
    file_pattern = file_pattern.replace(r"reshape\(-1, 4, 3\)", r"rewrite the dataset 'F'")
    with pytest.raises(ValueError, match=r"HDF5 file '.*bad\.h5': dataset" + file_pattern):
        _configure(path, weights=("w",))


def test_negative_weights_in_hdf5(tmp_path):
    data = small_data()
    data["w"][[0, 5]] = -1.0
    path = write_h5(tmp_path / "neg.h5", data)
    with pytest.raises(ValueError, match=r"neg\.h5': dataset\['w'\] holds 2 negative weight\(s\), in "
                                         r"structure\(s\) \[0, 5\]"):
        _configure(path, weights=("w",))
    _configure(path)  # weights not used by the trainer: the file is fine


def test_ranks_must_agree_on_the_hdf5_file(tmp_path):
    write_h5(tmp_path / "rank0.h5", small_data(n=6))
    write_h5(tmp_path / "rank1.h5", small_data(n=8))
    # each rank writes its outcome to its own file: two ranks printing at once
    # interleave their lines in mpirun's output
    code = textwrap.dedent(f"""
        from mpi4py import MPI
        from chemtrain.data import HDF5ParallelDataLoader
        from chemtrain.parallel import make_strategy
        s = make_strategy("mpi")
        rank = MPI.COMM_WORLD.rank
        loader = HDF5ParallelDataLoader({str(tmp_path)!r} + f"/rank{{rank}}.h5")
        try:
            loader.configure(2, training=True, seed=0, strategy=s, required=("R", "U", "F"))
            outcome = "CONFIGURED"
        except ValueError as e:
            outcome = f"REFUSED {{e}}"
        with open({str(tmp_path)!r} + f"/outcome{{rank}}.txt", "w") as f:
            f.write(outcome)
    """)
    rc, out, _ = mp.mpirun(2, ["-c", code], timeout=240)
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome{rank}.txt").read_text()
        assert re.match(r"REFUSED The processes of this run disagree on the HDF5 "
                        r"file .*rows and datasets", outcome), (rank, outcome)


# ---------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def ckpt_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "c.npz")
    trees = {"params": {"w": np.arange(12.0).reshape(3, 4), "b": np.ones(3, np.float32)}}
    checkpoint.save(path, trees, {"epoch": 3})
    return path


def test_every_flipped_byte_and_truncation_is_named(ckpt_file, tmp_path):
    raw = open(ckpt_file, "rb").read()
    meta, leaves = checkpoint.load(ckpt_file)
    assert meta["epoch"] == 3 and meta["format_version"] == checkpoint.FORMAT_VERSION
    np.testing.assert_array_equal(leaves["params"][1], np.arange(12.0).reshape(3, 4))
    bad = str(tmp_path / "bad.npz")
    outcomes = {}
    damaged = [(f"flip {i}", raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:]) for i in range(len(raw))]
    damaged += [(f"truncate {n}", raw[:n]) for n in range(len(raw))]
    for what, data in damaged:
        with open(bad, "wb") as f:
            f.write(data)
        try:
            checkpoint.load(bad)
            outcomes[what] = "loaded"
        except CheckpointError as e:
            outcomes[what] = "named" if "bad.npz" in str(e) else f"unnamed: {e}"
        except Exception as e:  # noqa: BLE001 - any other kind is a failure of the test
            outcomes[what] = f"{type(e).__name__}: {e}"
    wrong = {k: v for k, v in outcomes.items() if v != "named"}
    assert not wrong, list(wrong.items())[:5]
    assert len(outcomes) == 2 * len(raw)


def _npz_with_header(path, header, arrays=None):
    arrays = dict(arrays or {})
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    arrays["__meta__"] = np.frombuffer(text, np.uint8)
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("header,arrays,pattern", [
    (b"{not json", {}, r"not a chemtrain checkpoint or is damaged \(JSONDecodeError"),
    ([1, 2], {}, r"header is a list, not a JSON object"),
    ({"format_version": 1, "trees": {}}, {}, r"not a chemtrain checkpoint \(format None"),
    ({"format": "chemtrain-checkpoint", "trees": {}}, {}, r"format version None"),
    ({"format": "chemtrain-checkpoint", "format_version": 99, "trees": {}}, {}, r"version 99"),
    ({"format": "chemtrain-checkpoint", "format_version": 1}, {}, r"lacks a valid 'trees'"),
    ({"format": "chemtrain-checkpoint", "format_version": 1, "trees": {"p": "x"}}, {},
     r"lacks a valid 'trees'"),
    ({"format": "chemtrain-checkpoint", "format_version": 1, "trees": {"p": ["[0]", "[1]"]}},
     {"p/00000": np.zeros(2)}, r"lists 2 arrays of 'p' but 1 are missing \(\['p/00001'\]\)"),
    # a version-2 header without its checksum: the end of the file is gone or damaged
    ({"format": "chemtrain-checkpoint", "format_version": 2, "trees": {}}, {},
     r"must end with its SHA-256 checksum"),
])
def test_headers_without_fields(tmp_path, header, arrays, pattern):
    path = _npz_with_header(tmp_path / "h.npz", header, arrays)
    with pytest.raises(CheckpointError, match=r"'.*h\.npz'.*" + pattern):
        checkpoint.load(path)


def test_other_files_missing_file_and_fallback_loop(tmp_path, ckpt_file):
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "text.npz").write_text("not a checkpoint")
    np.save(tmp_path / "array.npy", np.zeros(3))
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    for name, pattern in [("empty.npz", "is empty"), ("text.npz", "not a chemtrain checkpoint"),
                          ("array.npy", "not a chemtrain checkpoint"),
                          ("plain.npz", "without the '__meta__' header"), (".", "a directory")]:
        with pytest.raises(CheckpointError, match=pattern):
            checkpoint.load(str(tmp_path / name))
    with pytest.raises(FileNotFoundError, match="missing.npz") as info:
        checkpoint.load(str(tmp_path / "missing.npz"))
    assert isinstance(info.value, CheckpointNotFoundError) and isinstance(info.value, CheckpointError)
    # a legacy version-1 file (no checksum) is still read
    v1 = _npz_with_header(tmp_path / "v1.npz", {"format": "chemtrain-checkpoint", "format_version": 1,
                                                "trees": {"p": ["[0]"]}, "epoch": 7},
                          {"p/00000": np.arange(3.0)})
    meta, leaves = checkpoint.load(v1)
    assert meta["epoch"] == 7 and leaves["p"][0].tolist() == [0.0, 1.0, 2.0]
    # "fall back to the previous checkpoint": newest first, damaged and missing ones skipped
    raw = open(ckpt_file, "rb").read()
    (tmp_path / "epoch_3.npz").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "epoch_2.npz").write_bytes(raw[:100] + b"\xff" + raw[101:])
    (tmp_path / "epoch_1.npz").write_bytes(raw)
    used = None
    for name in ("epoch_4.npz", "epoch_3.npz", "epoch_2.npz", "epoch_1.npz"):
        try:
            checkpoint.load(str(tmp_path / name))
            used = name
            break
        except CheckpointError:
            continue
    assert used == "epoch_1.npz"


def test_killed_write_keeps_old_file_and_leftover_is_cleaned(tmp_path):
    target = tmp_path / "c.npz"
    checkpoint.save(str(target), {"p": [np.arange(4.0)]}, {"epoch": 1})
    before = target.read_bytes()
    unrelated = tmp_path / ".other.npz.tmp-abcd1234"
    unrelated.write_bytes(b"x")
    # a real kill in the middle of the write: the file-size limit stops the
    # process with SIGXFSZ while it writes the temporary file
    res = run_py(f"""
        import resource, signal
        from chemtrain.checkpoint import atomic_write_bytes
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        atomic_write_bytes({str(target)!r}, b"y" * 1_000_000)
        print("NOT KILLED")
    """)
    assert res.returncode < 0 and "NOT KILLED" not in res.stdout, (res.returncode, res.stderr[-2000:])
    assert target.read_bytes() == before
    assert checkpoint.load(str(target))[0]["epoch"] == 1
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".c.npz.tmp-")]
    assert len(left) == 1 and not left[0].endswith(".npz"), left
    assert os.path.getsize(tmp_path / left[0]) == 100_000  # the interrupted write's partial file
    checkpoint.save(str(target), {"p": [np.arange(4.0)]}, {"epoch": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.npz.tmp-abcd1234", "c.npz"]
    assert checkpoint.load(str(target))[0]["epoch"] == 2


# ---------------------------------------------------------------- converter

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


# ---------------------------------------------------------------- MACE files

@pytest.fixture(scope="module")
def mace_file(tmp_path_factory):
    import jax
    import jax.numpy as jnp
    from chemtrain.models import mace as cm
    from chemtrain.models.mace import model as M
    cfg = M.MaceConfig(
        atomic_numbers=(1, 6), r_max=4.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=1,
        avg_num_neighbors=3.0, radial_mlp=(8,),
        layers=(M.Layer(M.RESIDUAL, "4x0e", "4x0e", "4x0e+4x1o", "4x0e", 2, "linear"),),
        mlp_irreps="4x0e", atomic_energies=(-13.6, -1030.0), scale=1.0, shift=0.0,
        act_constant=1.6791767923989418)
    params = jax.tree.map(np.asarray, cm.init_params(cfg, jax.random.PRNGKey(0), jnp.float64))
    path = str(tmp_path_factory.mktemp("mace") / "m.npz")
    cm.save(path, cfg, params)
    return path, cfg, params


def _edit(cfg, **changes):
    d = json.loads(cfg.to_json())
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d)


_DROP = object()
_LAYER = dict(interaction="RealAgnosticResidualInteractionBlock", node_irreps="4x0e",
              edge_irreps="4x0e", target_irreps="4x0e+4x1o", hidden_irreps="4x0e", correlation=2,
              readout="linear")


@pytest.mark.parametrize("change,pattern", [
    (dict(atomic_energies=[-13.6]), r"'atomic_energies' must hold one E0 per element: 2 .* got 1"),
    (dict(atomic_numbers=[6, 1]), r"'atomic_numbers' must be distinct .* increasing order, got \[6, 1\]"),
    (dict(atomic_numbers=[6, 6]), r"distinct"),
    (dict(atomic_numbers=[1, 6.0]), r"'atomic_numbers' must be an integer, got 6.0 \(entry 1\)"),
    (dict(r_max=-1.0), r"'r_max' must be a number > 0, got -1.0"),
    (dict(num_bessel="4"), r"'num_bessel' must be an integer, got '4'"),
    (dict(avg_num_neighbors=float("nan")), r"'avg_num_neighbors' must be a finite number"),
    (dict(layers=[]), r"'layers' must be a list of at least 1 entries, got 0"),
    (dict(layers=[dict(_LAYER, correlation=0)]), r"'layers': entry 0: 'correlation' must be an integer >= 1"),
    (dict(layers=[dict(_LAYER, node_irreps="4x9q")]), r"'node_irreps' must be an irreps string"),
    (dict(layers=[dict(_LAYER, readout="mlp")]), r"'readout' must be one of \['linear', 'nonlinear'\]"),
    (dict(layers=[_LAYER, dict(_LAYER, node_irreps="8x0e")]),
     r"layer 1 reads node features '8x0e' but layer 0 writes '4x0e'"),
    (dict(max_ell=_DROP), r"configuration lacks the field\(s\) \['max_ell'\]"),
    (dict(colour="red"), r"unknown field\(s\) \['colour'\]"),
    (dict(distance_transform="Agnesi"), r"'covalent_radii' .* must reach Z=6, got 0 entries"),
    (dict(radial_mlp=[16]), r"parameters do not fit the configuration.*\[16, 16\]|radial_mlp"),
    (dict(num_bessel=5), r"parameters do not fit the configuration.*radial_mlp.*\[4, 8\].*\[5, 8\]"),
])
def test_mace_load_refuses_configurations_that_do_not_fit(mace_file, tmp_path, change, pattern):
    from chemtrain.models import mace as cm
    path, cfg, params = mace_file
    assert cm.load(path)[0] == cfg  # the untouched file loads
    bad = str(tmp_path / "bad.npz")
    checkpoint.save(bad, {"params": params}, {"kind": "chemtrain-mace", "config": _edit(cfg, **change)})
    with pytest.raises(CheckpointError, match=r"'.*bad\.npz'.*" + pattern):
        cm.load(bad)


def test_mace_load_refuses_malformed_parameters_and_headers(mace_file, tmp_path):
    import jax
    from chemtrain.models import mace as cm
    path, cfg, params = mace_file
    bad = str(tmp_path / "bad.npz")
    cases = [
        ({"params": jax.tree.map(lambda x: x.astype(np.float32), params) | {"embedding": params["embedding"]}},
         {"config": cfg.to_json()}, r"must all be float32 or all float64, got dtypes \['float32', 'float64'\]"),
        ({"params": params | {"embedding": np.full_like(params["embedding"], np.nan)}},
         {"config": cfg.to_json()}, r"parameter\(s\) \['embedding'\] hold NaN or inf"),
        ({"params": params | {"embedding": params["embedding"][:, :3]}},
         {"config": cfg.to_json()}, r"do not fit the configuration.*\['embedding'\].*\[2, 3\].*\[2, 4\]"),
        ({"params": params}, {"config": "{oops"}, r"not valid JSON"),
        ({"params": params}, {"config": 5}, r"must be a JSON string"),
        ({"params": params}, {}, r"lacks the configuration"),
        ({"other": params}, {"config": cfg.to_json()}, r"lacks the parameters"),
    ]
    for trees, meta, pattern in cases:
        checkpoint.save(bad, trees, {"kind": "chemtrain-mace", **meta})
        with pytest.raises(CheckpointError, match=r"'.*bad\.npz'.*" + pattern):
            cm.load(bad)
    checkpoint.save(bad, {"params": params}, {"kind": "checkpoint", "config": cfg.to_json()})
    with pytest.raises(CheckpointError, match="not a MACE model"):
        cm.load(bad)
    raw = open(path, "rb").read()
    open(bad, "wb").write(raw[:-1000])
    with pytest.raises(CheckpointError, match=r"bad\.npz"):
        cm.load(bad)


def test_mace_torch_file_needs_consent_and_torch_stays_safe(tmp_path):
    """Reading a pickled .model needs trusted=True; afterwards torch.load's
    safe default still refuses an arbitrary pickled object. One fresh
    process: mace is imported first by chemtrain's loader."""
    model, evil = str(tmp_path / "tiny.model"), str(tmp_path / "evil.pt")
    res = run_py(f"""
        import argparse, importlib, os, pickle, sys
        from chemtrain.models import mace as cm
        from chemtrain.models.mace.torch_io import UntrustedFileError
        try:
            cm.load_mace_torch({model!r})
            print("READ WITHOUT CONSENT")
        except UntrustedFileError as e:
            print("REFUSED", e)
        print("torch imported before consent:", "torch" in sys.modules)

        def attempt(label):
            try:
                torch.load({evil!r})
                print(label, "UNPICKLED")
            except pickle.UnpicklingError:
                print(label, "REFUSED")

        import torch  # a pickled module that is no MACE model: mace is imported, then refused
        torch.save(torch.nn.Linear(2, 2), {model!r})
        torch.save(argparse.Namespace(payload="any object"), {evil!r})
        try:
            cm.load_mace_torch({model!r}, trusted=True)
        except ValueError as e:
            print("NOT MACE", "mace" in sys.modules, e)
        attempt("after the first load:")
        import numpy as np  # a real (tiny) mace-torch model; mace is imported already
        from e3nn import o3
        from mace import modules
        torch.set_default_dtype(torch.float64)
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        torch.save(modules.ScaleShiftMACE(
            r_max=4.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
            interaction_cls_first=block, num_interactions=1, num_elements=2,
            hidden_irreps=o3.Irreps("4x0e"), MLP_irreps=o3.Irreps("4x0e"),
            atomic_energies=np.array([-1.0, -2.0]), avg_num_neighbors=3.0, atomic_numbers=[1, 6],
            correlation=2, gate=torch.nn.functional.silu, atomic_inter_scale=1.0,
            atomic_inter_shift=0.0), {model!r})
        cfg, params = cm.load_mace_torch({model!r}, trusted=True)
        print("LOADED", cfg.atomic_numbers, "env:", os.environ.get({NO_SAFE_LOAD!r}))
        attempt("after the second load:")
        import mace
        importlib.reload(mace)  # what a first `import mace` does to the process
        attempt("after import mace:")
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "READ WITHOUT CONSENT" not in out
    assert re.search(r"REFUSED '.*tiny\.model' was not read: a mace-torch '\.model' file is a "
                     r"Python pickle.*run any code.*trusted=True", out), out
    assert "torch imported before consent: False" in out
    assert "NOT MACE True" in out and "Linear, not a mace-torch MACE model" in out
    assert "after the first load: REFUSED" in out
    assert "LOADED (1, 6) env: None" in out
    assert "after the second load: REFUSED" in out
    assert "after import mace: UNPICKLED" in out  # the checks above can fail: mace does switch it off

"""Reliability of the data side: no silently wrong shapes, every damaged
file named.

Target shapes (in memory and in HDF5 files), negative weights, the ranks'
agreement on an HDF5 file, MACE model files with configurations that do not
fit their parameters, and pickled mace-torch files that are read only with
consent, leaving torch's safe default as it was. (Damaged checkpoint files
are tested in test_checkpoint.py, the converter in data/test_convert.py.)
"""
from __future__ import annotations

import json
import re
import textwrap

import h5py
import numpy as np
import pytest

import mp
from chemtrain import checkpoint
from chemtrain.checkpoint import CheckpointError
from chemtrain.data import HDF5ParallelDataLoader, validate_dataset
from chemtrain.parallel import make_strategy
from fresh_python import NO_SAFE_LOAD, run_py


def small_data(n=6, atoms=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"R": rng.normal(size=(n, atoms, 3)), "U": rng.normal(size=n),
            "F": rng.normal(size=(n, atoms, 3)), "w": np.ones(n)}


def write_h5(path, data):
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
    return str(path)


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

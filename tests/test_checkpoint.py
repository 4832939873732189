"""Checkpoints: files damaged in every way (every single flipped byte, every
truncation, headers without fields, killed writes) are named, never
loaded; trainers refuse checkpoints of another batch and garbage,
write plain data, and do not overwrite another run's checkpoints."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from builders import build, trainer
from chemtrain import checkpoint
from chemtrain.checkpoint import CheckpointError, CheckpointNotFoundError
from fresh_python import run_py


# ---------------------------------------------------------------- files

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


# ---------------------------------------------------------------- trainers

def test_checkpoint_of_another_batch_and_garbage(tmp_path):
    """A checkpoint restores on another number of devices (elastic resume,
    tests/trainers/test_elastic_resume.py) but not with another global
    batch, which would change what every later step sees."""
    tr, data = build(tmp_path)
    tr.save_checkpoint(str(tmp_path / "one.npz"))
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    tr2, _ = build(tmp_path, parallelism="jax", mesh=mesh)
    tr2.restore(str(tmp_path / "one.npz"))
    tr3, _ = build(tmp_path, parallelism="jax", mesh=mesh, batch=8)
    with pytest.raises(CheckpointError, match="batch=4; this run has batch=8. Resume with "
                                              "the checkpoint's settings"):
        tr3.restore(str(tmp_path / "one.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a chemtrain checkpoint"):
        tr.restore(str(tmp_path / "junk.npz"))
    with pytest.raises(FileNotFoundError):
        tr.restore(str(tmp_path / "missing.npz"))


def test_checkpoint_is_plain_data(tmp_path):
    tr, _ = build(tmp_path)
    tr.save_checkpoint(str(tmp_path / "c.npz"))
    with np.load(tmp_path / "c.npz", allow_pickle=False) as z:  # raises on pickled objects
        assert all(z[k].dtype != object for k in z.files)


def test_a_new_run_does_not_overwrite_another_runs_checkpoints(problem, tmp_path):
    data = problem[0]
    first = trainer(problem, tmp_path)
    first.set_datasets(data)
    first.train(1, checkpoint_freq=1)
    written = (tmp_path / "epoch_00001.npz").read_bytes()
    second = trainer(problem, tmp_path)
    second.set_datasets(data)
    with pytest.raises(CheckpointError, match="already holds checkpoints of another run"):
        second.train(1, checkpoint_freq=1)
    assert (tmp_path / "epoch_00001.npz").read_bytes() == written and second.epoch == 0
    second.restore(str(tmp_path / "epoch_00001.npz"))  # continuing that run is fine
    second.train(1, checkpoint_freq=1)
    assert (tmp_path / "epoch_00002.npz").exists()

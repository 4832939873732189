"""chemtrain.compile_cache: JAX's persistent compilation cache, on by
default for chemtrain's jobs. Each case runs in fresh processes (the
test session's own cache is configured by conftest): a second process
reads the programs the first wrote; a trainer turns the cache on; 'off',
an unwritable folder and a cache folder the user chose are respected."""
import json
import os

import pytest

from fresh_python import run_py

PROGRAM = """
    import json, jax, jax.numpy as jnp
    from jax import monitoring
    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)
    import chemtrain.compile_cache as cc
    folder = cc.enable({arg})
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    f = jax.jit(lambda x: jnp.sin(x) @ x.T + {salt})
    f(jnp.ones((40, 40))).block_until_ready()
    print("RESULT", json.dumps({{"folder": folder, "hits": len(hits),
                                "dir": jax.config.jax_compilation_cache_dir}}))
"""


def _run(tmp_path, arg="None", salt=1.0, **env):
    env.setdefault("CHEMTRAIN_JAX_CACHE", str(tmp_path / "cache"))
    r = run_py(PROGRAM.format(arg=arg, salt=salt), timeout=300, HOME=str(tmp_path / "home"),
               XDG_CACHE_HOME="", **env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), r.stderr


def _entries(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith("-cache"))


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    first, _ = _run(tmp_path)
    folder = str(tmp_path / "cache")
    assert first == {"folder": folder, "hits": 0, "dir": folder}
    written = _entries(folder)
    assert written, os.listdir(folder)
    second, _ = _run(tmp_path)
    assert second["hits"] >= 1 and _entries(folder) == written
    _run(tmp_path, salt=2.0)      # another program: compiled and added
    assert set(_entries(folder)) > set(written)


def test_default_folder_off_unwritable_and_the_users_own(tmp_path):
    # default (the variable empty, as unset): ~/.cache/chemtrain/jax of this HOME
    got, _ = _run(tmp_path, CHEMTRAIN_JAX_CACHE="")
    assert got["folder"] == str(tmp_path / "home" / ".cache" / "chemtrain" / "jax")
    assert _entries(got["folder"])
    for off in ("off", "0", "none"):
        got, _ = _run(tmp_path, CHEMTRAIN_JAX_CACHE=off)
        assert got == {"folder": None, "hits": 0, "dir": None}
    got, _ = _run(tmp_path, arg="'off'")
    assert got["folder"] is None
    # a folder that cannot be made: a warning, and the run goes on without
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = run_py("""
        import chemtrain.compile_cache as cc
        print("RESULT", [cc.enable(), cc.enable()])""", CHEMTRAIN_JAX_CACHE=str(blocker / "cache"))
    assert "RESULT [None, None]" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("compilation cache stays off") == 1, r.stderr   # once, not per trainer
    # the user's own JAX cache folder is kept
    got, _ = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert got["folder"] == got["dir"] == str(tmp_path / "mine")
    r = run_py("import chemtrain.compile_cache as cc; cc.enable()",
               CHEMTRAIN_JAX_CACHE=str(tmp_path / "c"), CHEMTRAIN_JAX_CACHE_MAX_GB="lots")
    assert r.returncode != 0 and "CHEMTRAIN_JAX_CACHE_MAX_GB must be a size in gigabytes" \
        in r.stderr, r.stderr[-2000:]


def test_the_default_folder_is_the_users_cache_and_clear_removes_it(tmp_path, monkeypatch):
    from chemtrain import compile_cache as cc
    monkeypatch.delenv("CHEMTRAIN_JAX_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cc.default_folder() == str(tmp_path / ".cache" / "chemtrain" / "jax")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.default_folder() == str(tmp_path / "xdg" / "chemtrain" / "jax")
    os.makedirs(tmp_path / "xdg" / "chemtrain" / "jax" / "x")
    cc.clear()
    assert not os.path.exists(tmp_path / "xdg" / "chemtrain" / "jax")
    cc.clear()   # nothing to delete: fine


def test_a_trainer_turns_the_cache_on(tmp_path):
    r = run_py("""
        import jax, optax
        from problems import mlp_problem
        from chemtrain.trainers import ForceMatching, RunOptions
        data, params, template, nbrs = mlp_problem()
        assert jax.config.jax_compilation_cache_dir is None
        ForceMatching(params, optax.adam(1e-3), template, nbrs, batch=2, parallelism="single",
                      checkpoint_path="{ck}", options=RunOptions(progress=False))
        print("DIR", jax.config.jax_compilation_cache_dir)
    """.replace("{ck}", str(tmp_path / "ck")), CHEMTRAIN_JAX_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"DIR {tmp_path / 'cache'}" in r.stdout

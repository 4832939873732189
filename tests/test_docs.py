"""The documentation: the site builds with warnings as errors, every Python
block of the guides runs as a user would run it (fresh process, one CPU
device, default precision, output to a file), and what it prints is quiet:
no third-party warnings, no progress-bar fragments."""
from __future__ import annotations

import glob
import inspect
import os
import re
import subprocess
import sys

import pytest

from paths import ROOT
RUNNER = os.path.join(ROOT, "tests", "_support", "doc_snippets.py")
PAGES = sorted(p for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
               if "_build" not in p and "```python" in open(p).read())


def user_env():
    """The environment of a user's shell: none of the test session's JAX settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_ENABLE_X64", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
           and not k.startswith("CHEMTRAIN_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return env


def run_blocks(path, cwd, only_first=False):
    args = [sys.executable, RUNNER, path] + (["--first"] if only_first else [])
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=user_env(),
                          timeout=600)


def test_every_guide_with_code_is_collected():
    names = {os.path.relpath(p, ROOT) for p in PAGES}
    for page in ("force_matching", "data", "mace", "difftre", "relative_entropy",
                 "priors_fused", "checkpoints"):
        assert f"docs/guides/{page}.md" in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "docs")))
def test_page_blocks_run_quietly(page, tmp_path):
    out = run_blocks(page, tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "block(s) ran" in out.stdout
    # quiet: no library warning and no redrawn progress bar in a log file
    assert not re.search(r"\w+Warning\b", text), text[-4000:]
    assert "\r" not in text and "it/s" not in text, text[-2000:]


def test_readme_force_matching_block_runs(tmp_path):
    out = run_blocks(os.path.join(ROOT, "README.md"), tmp_path, only_first=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "'F': {'MAE'" in out.stdout


def test_readme_is_a_front_door():
    lines = open(os.path.join(ROOT, "README.md")).read().split("\n")
    assert len(lines) <= 150
    assert lines[:4] == ["```bash",
                         "bash scripts/setup.sh && .venv/bin/python examples/mace_jax/finetune_md22.py",
                         "bash scripts/setup.sh && .venv/bin/python -m pytest", "```"]


def test_site_builds_without_warnings(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html",
                          os.path.join(ROOT, "docs"), str(tmp_path / "html"),
                          "-d", str(tmp_path / "doctrees")],
                         capture_output=True, text=True, cwd=ROOT, env=user_env(), timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    index = (tmp_path / "html" / "index.html").read_text()
    assert "Force matching" in index
    api = (tmp_path / "html" / "api" / "generated" / "chemtrain.trainers.DifftreParallel.html")
    assert "sim_batch_size" in api.read_text() and "parallelism" in api.read_text()


def test_reweighting_trainers_show_every_keyword():
    """help() and the reference show the accepted names: no **options, and the
    defaults are the loop's own."""
    from chemtrain.trainers import (Difftre, DifftreParallel, ForceMatching, RelativeEntropy,
                                    Reweighting)
    core = inspect.signature(Reweighting.__init__).parameters
    for cls in (DifftreParallel, Difftre, RelativeEntropy, ForceMatching):
        params = inspect.signature(cls).parameters
        assert not [p for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert "parallelism" in params
        if cls is ForceMatching:
            continue
        assert "sim_batch_size" in params
        for name, p in core.items():
            if name in ("self", "objective", "key", "init_params", "optimizer"):
                continue   # what the public constructors choose themselves
            assert name in params, (cls.__name__, name)
            assert params[name].default == p.default, (cls.__name__, name)


PUBLIC = ["chemtrain.trainers", "chemtrain.learn", "chemtrain.models", "chemtrain.models.mace",
          "chemtrain.models.nequip", "chemtrain.data",
          "chemtrain.neighbors", "chemtrain.simulate", "chemtrain.quantity", "chemtrain.parallel",
          "chemtrain.calculator", "chemtrain.checkpoint", "chemtrain.units", "chemtrain.finetune"]


def test_public_names_document_their_arguments():
    """Every public function and class of the API reference has a docstring,
    with an ``Args:`` section (Google style) when it takes arguments."""
    import importlib
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    missing = []
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [
            n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
            and getattr(v, "__module__", "") == module_name]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            try:
                takes = [p for p in inspect.signature(obj).parameters if p != "self"]
            except (TypeError, ValueError):
                takes = []
            if not doc or (takes and "Args:" not in doc and "Attributes:" not in doc):
                missing.append(f"{module_name}.{name}")
    assert not missing, f"{len(missing)} public names lack a docstring with Args: {missing}"

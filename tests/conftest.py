"""Test set-up: four CPU devices and float64, before JAX is imported."""
import atexit
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chemtrain  # noqa: E402,F401  (first: defers jax_md.rigid_body's costly import)
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

# The session's folder: its JAX compilation cache (tests build many
# identical programs, the same small models and systems in new trainers,
# and each is compiled once) and the lock files by which pytest-xdist
# workers share the cores (_support/cores.py). xdist's workers inherit the
# folder of the pytest process that started them; that process removes it.
_ROOT = os.environ.get("CHEMTRAIN_TEST_CACHE_ROOT", "")
if not (os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(_ROOT)):
    _ROOT = tempfile.mkdtemp(prefix="chemtrain-test-session-")
    atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    os.environ["CHEMTRAIN_TEST_CACHE_ROOT"] = _ROOT
# chemtrain's default cache (~/.cache/chemtrain/jax) stays out of the tests
# (tests/test_compile_cache.py sets its own folders): the processes they start
# that do not call mp.session_compile_cache (chemtrain-finetune jobs, the
# examples) find the session's cache through chemtrain's own variable
os.environ["CHEMTRAIN_JAX_CACHE"] = os.path.join(_ROOT, "jax")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_support"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import cores  # noqa: E402
import mp  # noqa: E402

mp.session_compile_cache()


def pytest_configure(config):
    config.addinivalue_line("markers", "all_cores: the test runs alone, no other xdist "
                            "worker's test beside it (it starts several processes itself)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test (set-up and tear-down included) holds a turn on the cores:
    shared, or exclusive when marked ``all_cores``."""
    with cores.timeline(item.nodeid), \
            cores.turn(exclusive=item.get_closest_marker("all_cores") is not None):
        yield


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The fixed problem trained in this process on one device."""
    import optax
    from chemtrain.trainers import ForceMatching, RunOptions
    from problems import FIXED, mlp_problem
    data, params, template, nbrs = mlp_problem()
    tr = ForceMatching(params, optax.chain(optax.adam(1e-3)), template, nbrs,
                       batch=FIXED["batch"], parallelism="single", gammas=FIXED["gammas"],
                       checkpoint_path=str(tmp_path_factory.mktemp("ref")),
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=FIXED["train_ratio"], val_ratio=FIXED["val_ratio"])
    tr.train(FIXED["epochs"])
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, tr.params))[0]
    return {jax.tree_util.keystr(k): v for k, v in flat}, tr.train_losses, tr.val_losses, params


@pytest.fixture(scope="module")
def problem():
    """(dataset, init_params, template, nbrs_init) of the pair-MLP problem
    (trainers/test_services.py, test_checkpoint.py)."""
    from problems import mlp_problem
    return mlp_problem()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """name -> random mace-torch model file, its conversion and the export
    of the conversion (built on first use; mace_calc.model_cache), shared by
    models/mace/test_export.py and test_calculator.py: a few small models, built once."""
    from mace_calc import model_cache
    return model_cache(tmp_path_factory.mktemp("export"))

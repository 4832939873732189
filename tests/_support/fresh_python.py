"""Run a snippet of Python in a fresh process (CPU, the repository and the
test helpers importable, torch's safe-load switch not inherited)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/
ROOT = os.path.dirname(HERE)
NO_SAFE_LOAD = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def run_py(code, timeout=300, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != NO_SAFE_LOAD}
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.path.join(HERE, "_support")]), **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)

"""Several ``chemtrain-finetune`` jobs in one subprocess (one start of
Python and JAX), or under ``mpirun -np 2``; the output of each job by name."""
import json
import re
import subprocess
import sys

import mp

DRIVER = """
import os, sys, json
from chemtrain.finetune import run
root = os.environ.get("PMI_RANK", "0") == "0"
for name, argv in json.loads(sys.argv[1]):
    if root:
        print(f"=== job {name} ===", flush=True)
    run(argv)
    sys.stdout.flush()
"""


def run_jobs(jobs, method, timeout=1200):
    """Run ``jobs`` ([(name, argv), ...]) in order; {name: its output}."""
    args = ["-c", DRIVER, json.dumps(jobs)]
    if method == "mpi":
        code, text, _ = mp.mpirun(2, args, devices=1, timeout=timeout)
    else:
        out = subprocess.run([sys.executable, *args], env=mp.env(devices=2), capture_output=True,
                             text=True, timeout=timeout)
        code, text = out.returncode, out.stdout + out.stderr
    assert code == 0, text[-4000:]
    parts = re.split(r"=== job (\S+) ===\n", text)
    return dict(zip(parts[1::2], parts[2::2]))

"""What the main job compiles, and what that costs: JAX's own counts.

    .venv/bin/python benchmarks/compilations.py                   # cache off, then cold, then warm
    .venv/bin/python benchmarks/compilations.py --runs off warm   # any sequence of the three

Runs the main job (``examples/mace_jax/finetune_md22.py``, a call of
``chemtrain-finetune``) in a fresh process per run and counts, through
``jax.monitoring``, the programs XLA compiles and the seconds spent tracing,
lowering and compiling them, and the persistent-cache hits. Runs:

- ``off``: no persistent compilation cache (``--jax_cache off``);
- ``cold``: an empty cache folder (a user's first run);
- ``warm``: the folder the last ``cold`` run filled (a second run).

Prints a line per run and one JSON line with all figures: the number of
programs compiled, each stage's total seconds, cache hits, the first
epoch's and the median later epoch's time (from ``metrics.jsonl``) and the
run's wall time. The job's output goes to ``--work``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "mace_jax", "finetune_md22.py")

# the child: the main job with JAX's events counted
CHILD = r"""
import collections, json, runpy, sys, time
import jax.monitoring as mon
count, secs = collections.Counter(), collections.Counter()
mon.register_event_listener(lambda name, **kw: count.update([name]))
def duration(name, s, **kw):
    count.update([name]); secs[name] += s
mon.register_event_duration_secs_listener(duration)
out, example, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [example, *argv]
t = time.perf_counter()
try:
    runpy.run_path(example, run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
wall = time.perf_counter() - t
json.dump({"wall_s": wall, "count": count, "secs": secs}, open(out, "w"))
"""
STAGES = {"programs": "/jax/core/compile/backend_compile_duration",
          "trace_s": "/jax/core/compile/jaxpr_trace_duration",
          "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration"}


def run(kind, work, cache, k):
    folder = os.path.join(work, f"{kind}_{k}")
    events = os.path.join(work, f"{kind}_{k}.json")
    argv = ["--results_dir", folder, "--jax_cache", "off" if kind == "off" else cache]
    subprocess.run([sys.executable, "-c", CHILD, events, EXAMPLE, *argv], check=True,
                   stdout=subprocess.DEVNULL)
    ev = json.load(open(events))
    epochs = [json.loads(line)["time_s"] for line in open(os.path.join(folder, "metrics.jsonl"))]
    out = {"run": kind, "wall_s": round(ev["wall_s"], 2),
           "programs": ev["count"].get(STAGES["programs"], 0),
           "compile_s": round(ev["secs"].get(STAGES["programs"], 0.0), 2),
           "trace_s": round(ev["secs"].get(STAGES["trace_s"], 0.0), 2),
           "lower_s": round(ev["secs"].get(STAGES["lower_s"], 0.0), 2),
           "cache_hits": ev["count"].get("/jax/compilation_cache/cache_hits", 0),
           "first_epoch_s": round(epochs[0], 2),
           "later_epoch_s": round(statistics.median(epochs[1:]), 2)}
    print(f"{kind:>5}: {out['programs']} programs compiled ({out['compile_s']} s; tracing "
          f"{out['trace_s']} s, lowering {out['lower_s']} s), {out['cache_hits']} cache hits; "
          f"first epoch {out['first_epoch_s']} s, later {out['later_epoch_s']} s; "
          f"run {out['wall_s']} s", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", choices=("off", "cold", "warm"),
                   default=["off", "cold", "warm"])
    p.add_argument("--work", default=None,
                   help="folder for the runs (default: a new temporary one)")
    args = p.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="chemtrain-compilations-")
    cache = os.path.join(work, "cache")
    results = []
    for k, kind in enumerate(args.runs):
        if kind == "cold":
            import shutil
            shutil.rmtree(cache, ignore_errors=True)
        results.append(run(kind, work, cache, k))
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    main()

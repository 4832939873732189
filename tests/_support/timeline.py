"""Where a suite's time went, from its timeline (issue 51):

    CHEMTRAIN_TEST_TIMELINE=/tmp/timeline.jsonl .venv/bin/python -m pytest
    .venv/bin/python tests/_support/timeline.py /tmp/timeline.jsonl [--files 20]

Prints per worker its busy time, the time its tests waited for a turn on the
cores (cores.py) and the CPU time of the worker and of the processes its
tests started; then the files with the most wall time, and the tests that
waited longest. The lines come from ``cores.timeline`` (conftest).
"""
import argparse
import collections
import json


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timeline")
    p.add_argument("--files", type=int, default=20, help="files to list")
    p.add_argument("--waits", type=int, default=10, help="tests that waited longest to list")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in open(args.timeline)]
    t0 = min(r["start"] for r in rows)
    t1 = max(r["end"] for r in rows)
    print(f"{len(rows)} tests in {(t1 - t0) / 60:.1f} min (first start to last end)")
    workers = collections.defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    for w, rs in sorted(workers.items()):
        print(f"{w}: ends at {max(r['end'] for r in rs) - t0:.0f} s, "
              f"busy {sum(r['end'] - r['start'] for r in rs) / 60:.1f} min, "
              f"waited {sum(r['waited'] for r in rs) / 60:.1f} min, "
              f"CPU {sum(r['cpu'] for r in rs) / 60:.1f} min "
              f"+ started processes {sum(r['cpu_children'] for r in rs) / 60:.1f} min")
    files = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f.update({"wall": r["end"] - r["start"], "waited": r["waited"], "cpu": r["cpu"],
                  "children": r["cpu_children"], "tests": 1})
    print(f"\n{'file':58s} {'wall s':>7s} {'waited':>7s} {'CPU':>6s} {'procs':>6s} tests")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:args.files]:
        print(f"{name:58s} {f['wall']:7.0f} {f['waited']:7.0f} {f['cpu']:6.0f} "
              f"{f['children']:6.0f} {f['tests']:5d}")
    print(f"\n{'waited s':>8s} {'wall s':>7s} test")
    for r in sorted(rows, key=lambda r: -r["waited"])[:args.waits]:
        print(f"{r['waited']:8.0f} {r['end'] - r['start']:7.0f} {r['test']}")


if __name__ == "__main__":
    main()

"""The strategy contract: run every member of a strategy and record what it
returned, so that a test can compare with values computed here in numpy.

Run as a script under mpirun or as jax.distributed processes, each process
writes its record to ``<out>/contract_<rank>.json``; then the last process
calls ``abort`` while the others wait in a collective, so that the launcher
must end them all.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

DATA = np.arange(20.0).reshape(10, 2) / 7.0
IDX = np.array([9, 0, 3, 5, 1, 8, 2, 7, 6, 4])
W = np.array([0.5, -1.5])


def exercise(s) -> dict:
    """Call every member of strategy ``s``; return a JSON-like record."""
    import jax
    import jax.numpy as jnp
    from chemtrain.data.loader import describe
    r = s.process_index
    rec = {"process_index": r, "process_count": s.process_count, "n_shards": s.n_shards,
           "is_root": s.is_root, "name": s.name, "describe": s.describe()}
    # Comm
    rec["bcast_object"] = s.bcast_object({"from": r})
    rec["broadcast_from_root"] = s.broadcast_from_root({"x": np.full(3, float(r))})["x"].tolist()
    rec["host_allgather"] = [np.asarray(v).tolist() for v in s.host_allgather(np.array([r, 10 * r]))]
    rec["host_allgather_object"] = s.host_allgather_object({"r": r})
    summed = s.host_sum({"a": np.full(2, r + 1.0), "b": np.int64(r)})
    rec["host_sum"] = {"a": np.asarray(summed["a"]).tolist(), "b": int(summed["b"])}
    rec["host_max"] = float(s.host_max(float(r)))
    rec["local_items"] = list(s.local_items(5))
    s.check_same({"k": 1}, "a constant")
    try:
        s.check_same({"rank": r}, "the rank")
        rec["check_same"] = None
    except ValueError as e:
        rec["check_same"] = str(e)
    with s.failure_guard():
        rec["failure_guard"] = "entered"
    # Sharding
    batch = 2 * s.n_shards
    rec["check_batch"] = s.check_batch(batch)
    try:
        s.check_batch(batch + 1) if s.n_shards > 1 else s.check_batch(0)
        rec["check_batch_error"] = None
    except ValueError as e:
        rec["check_batch_error"] = str(e)
    rows = s.local_rows(batch)
    rec["local_rows"] = [rows.start, rows.stop]
    data = {"x": DATA} if (s.is_root or not s.scatters_from_root) else None
    rec["scatters_from_root"] = s.scatters_from_root
    local = s.select_rows(data, IDX, describe({"x": DATA}), batch)
    rec["select_rows"] = np.asarray(local["x"]).tolist()
    params = s.replicate({"w": W})
    device_batch = s.place_batch(local)

    def per_shard(p, b):
        p = s.vary(p)
        loss, grad = jax.value_and_grad(lambda q: jnp.sum((b["x"] @ q["w"]) ** 2))(p)
        return s.sum(loss), s.mean(loss), s.mean_gradient(grad), 2.0 * b["x"]

    fn = s.compile(per_shard, (False, True), (False, False, False, True))
    total, mean, grad, doubled = fn(params, device_batch)
    rec["sum"] = float(s.to_host(total))
    rec["mean"] = float(s.to_host(mean))
    rec["mean_gradient"] = np.asarray(s.to_host(grad)["w"]).tolist()
    rec["to_host_sharded"] = np.asarray(s.to_host(doubled, sharded=True)).tolist()
    rec["abort"] = repr(s.abort("contract: abort") if s.process_count == 1 else "not called")
    return rec


def expected(n_shards: int, process_count: int, rank: int) -> dict:
    """What :func:`exercise` must record on process ``rank``, from numpy."""
    batch = 2 * n_shards
    per_process = batch // process_count
    rows = slice(rank * per_process, (rank + 1) * per_process)
    x = DATA[IDX[:batch]]
    shard_losses = [np.sum((x[2 * i:2 * i + 2] @ W) ** 2) for i in range(n_shards)]
    shard_grads = [2 * x[2 * i:2 * i + 2].T @ (x[2 * i:2 * i + 2] @ W) for i in range(n_shards)]
    base, extra = divmod(5, process_count)
    start = rank * base + min(rank, extra)
    return {
        "process_index": rank, "process_count": process_count, "n_shards": n_shards,
        "is_root": rank == 0,
        "bcast_object": {"from": 0},
        "broadcast_from_root": [0.0, 0.0, 0.0],
        "host_allgather": [[p, 10 * p] for p in range(process_count)],
        "host_allgather_object": [{"r": p} for p in range(process_count)],
        "host_sum": {"a": [process_count * (process_count + 1) / 2] * 2,
                     "b": process_count * (process_count - 1) // 2},
        "host_max": float(process_count - 1),
        "local_items": list(range(start, start + base + (rank < extra))),
        "failure_guard": "entered",
        "check_batch": 2,
        "local_rows": [rows.start, rows.stop],
        "select_rows": DATA[IDX[rows]].tolist(),
        "sum": float(np.sum(shard_losses)),
        "mean": float(np.mean(shard_losses)),
        "mean_gradient": np.mean(shard_grads, axis=0).tolist(),
        "to_host_sharded": (2.0 * x).tolist(),
        "abort": "None" if process_count == 1 else repr("not called"),
    }


def main():
    import mp
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallelism", required=True)
    parser.add_argument("--out", required=True)
    mp.add_launch_args(parser)
    args = parser.parse_args()
    import jax
    jax.config.update("jax_enable_x64", True)
    mp.init_jax_distributed(args)
    from chemtrain.parallel import make_strategy
    s = make_strategy(args.parallelism)
    rec = exercise(s)
    with open(os.path.join(args.out, f"contract_{s.process_index}.json"), "w") as f:
        json.dump(rec, f)
    s.host_allgather_object("written")  # every record is on disk before the abort
    if s.process_index == s.process_count - 1:
        s.abort(f"contract: process {s.process_index} ends the run")
    s.host_allgather_object("waiting for the end")  # only the abort ends this
    with open(os.path.join(args.out, f"not_ended_{s.process_index}"), "w") as f:
        f.write("a collective returned after abort")


if __name__ == "__main__":
    main()

"""Files of the reweighting trainers: trajectory states as plain data.

A trajectory state holds jax-md dataclasses whose static fields (the
neighbor list's capacity, its update function) are not data. The arrays are
saved with the capacities next to them; loading rebuilds the structure from
the trainer's own functions (an initial state at the reference positions
with the saved capacity, traced through the trajectory function without
running it) and checks every saved leaf against it. No pickle anywhere.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import checkpoint as ckpt
from ..checkpoint import check_kind
from ..checksum import crc


def trajstates_to_host(trajstates: dict, statepoints=None) -> tuple[dict, dict]:
    """(numpy pytree, JSON-able info) of ``{state point: [TrajState per chain]}``;
    with ``statepoints`` the info also records each state point's
    ``state_kwargs`` (:func:`kwargs_record`), checked when loading."""
    data, info = {}, {}
    for i in sorted(trajstates):
        data[f"{i:05d}"] = [jax.tree.map(np.asarray, t) for t in trajstates[i]]
        extra = {} if statepoints is None else {"state_kwargs": kwargs_record(statepoints[i])}
        info[f"{i:05d}"] = [{"max_occupancy": int(t.nbrs.max_occupancy),
                             "cell_list_capacity": None if t.nbrs.cell_list_capacity is None
                             else int(t.nbrs.cell_list_capacity),
                             "format": str(t.nbrs.format), **extra} for t in trajstates[i]]
    return data, info


def kwargs_record(sp) -> dict:
    """What a trajectory file records of the ``state_kwargs`` it was sampled
    with: a checksum, and the scalar values for messages."""
    total, shown = 0, {}
    for k in sorted(sp.state_kwargs):
        a = np.asarray(sp.state_kwargs[k])
        total = crc(k, a, start=total)
        if a.size == 1:
            shown[k] = float(a.reshape(()))
    return {"crc": total, "values": shown}


def _check_saved(path, i, sp, chains) -> None:
    """Refuse trajectories saved for state point ``i`` that were sampled with
    other ``state_kwargs`` than ``sp`` has."""
    for ci in chains:
        saved = ci.get("state_kwargs")
        if saved is not None and saved["crc"] != kwargs_record(sp)["crc"]:
            raise ckpt.CheckpointError(
                f"{path!r} holds trajectories of state point {i} sampled with state_kwargs "
                f"{saved['values']}, but state point {i} of this trainer has "
                f"{kwargs_record(sp)['values']} (other values or arrays): were the state points "
                f"reordered or changed? Add them in the order of the saved run, or sample new "
                f"trajectories (initialize_trajstates()).")


def pack(trajstates: dict) -> dict:
    """``{state point: [(info, leaves)]}``: trajectory states as plain numpy
    leaves plus capacities, to send to other processes (see :func:`unpack`)."""
    data, info = trajstates_to_host(trajstates)
    return {i: [(ci, jax.tree.leaves(t)) for ci, t in zip(info[f"{i:05d}"], data[f"{i:05d}"])]
            for i in sorted(trajstates)}


def unpack(statepoints, params, packed: dict, held: dict) -> dict:
    """Inverse of :func:`pack` on a process that holds the same
    ``statepoints`` (:class:`~chemtrain.learn.statepoint.StatePoint`): the
    structure of each state is that of the trajectories this process
    ``held`` for the state point (jax-md's static fields included), or,
    where it holds none yet, built from the state point's own functions at
    ``params`` (see :func:`_template`)."""
    out, templates = {}, {}
    for i, chains in packed.items():
        sp = statepoints[i]
        mine = held.get(i)
        out[i] = [jax.tree.map(jnp.asarray, jax.tree.unflatten(jax.tree.structure(
            mine[c] if mine is not None and _capacities(mine[c]) == (
                int(ci["max_occupancy"]), ci["cell_list_capacity"])
            else _template(sp, params, c, ci, templates)), leaves))
            for c, (ci, leaves) in enumerate(chains)]
    return out


def _capacities(t) -> tuple:
    """The static capacities of a trajectory state's neighbor list."""
    cells = t.nbrs.cell_list_capacity
    return int(t.nbrs.max_occupancy), None if cells is None else int(cells)


def check_replaceable(path: str, run_id: str) -> None:
    """Refuse to write trajectory states over ``path`` unless it is absent or
    holds trajectory states of run ``run_id`` (a checkpoint, another run's
    file or a file that is no chemtrain file would be lost)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    try:
        meta = ckpt.load(path)[0]
    except (ckpt.CheckpointError, OSError):
        meta = {}
    if meta.get("kind") == "trajstates" and meta.get("run_id") == run_id:
        return
    what = (f"a {meta['kind']} of run {meta.get('run_id')}" if meta.get("kind")
            else "not a trajectory-state file")
    raise FileExistsError(f"{path!r} exists and is {what}; save_trajstates does not write over "
                          f"it. Choose another path, or pass overwrite=True.")


def pool_to_host(older: dict) -> tuple[dict, dict]:
    """(numpy pytree, JSON-able info) of the pools' earlier trajectories
    ``{state point: [[TrajState per chain] per trajectory]}``, as
    :func:`trajstates_to_host` writes each."""
    data, info = {}, {}
    for i in sorted(k for k, slots in older.items() if slots):
        d, n = trajstates_to_host(dict(enumerate(older[i])))
        data[f"{i:05d}"] = [d[f"{k:05d}"] for k in range(len(older[i]))]
        info[f"{i:05d}"] = [n[f"{k:05d}"] for k in range(len(older[i]))]
    return data, info


def pool_from_host(statepoints, params, meta: dict, leaves, path) -> dict:
    """Inverse of :func:`pool_to_host` from a file's 'trajpool' tree (empty
    without one), checked leaf by leaf as :func:`trajstates_from_host`."""
    info = meta.get("trajpool") or {}
    if not info:
        return {}
    cache = {}
    template = {k: [[_template(statepoints[int(k)], params, c, ci, cache)
                     for c, ci in enumerate(slot)] for slot in slots]
                for k, slots in info.items()}
    host = ckpt.unflatten_like(template, leaves, meta["trees"]["trajpool"], "trajpool")
    return {int(k): [[jax.tree.map(jnp.asarray, t) for t in slot] for slot in slots]
            for k, slots in host.items()}


def read(path: str, trainer_name: str):
    """(meta, leaves of the 'trajstates' tree, leaves of the 'trajpool' tree
    or None) of a trajectory-state file or a checkpoint; refuses error
    states and other trainers' files."""
    meta, leaves = ckpt.load(os.fspath(path))
    check_kind(path, meta, ("checkpoint", "trajstates"))
    if meta.get("trainer", trainer_name) != trainer_name:
        raise ckpt.CheckpointError(f"{path!r} was written by {meta['trainer']}, not "
                                   f"{trainer_name}.")
    if "trajstates" not in leaves:
        raise ckpt.CheckpointError(f"{path!r} holds no trajectory states.")
    return meta, leaves["trajstates"], leaves.get("trajpool")


def _template(sp, params, chain: int, info: dict, cache: dict):
    """Zero arrays shaped like a saved TrajState of state point ``sp``
    (chain ``chain``), kept in ``cache`` (one call's) per state point and
    capacity."""
    key = jax.random.PRNGKey(0)
    tag = (sp.index, chain, int(info["max_occupancy"]), info["cell_list_capacity"])
    if tag in cache:
        return cache[tag]
    t0 = sp.init_fn(params, key, sp.reference[chain], **sp.state_kwargs)
    cap = int(info["max_occupancy"])
    nbrs = dataclasses.replace(t0.nbrs, max_occupancy=cap,
                               cell_list_capacity=info["cell_list_capacity"],
                               idx=jnp.zeros(t0.nbrs.idx.shape[:-1] + (cap,), t0.nbrs.idx.dtype))
    shapes = jax.eval_shape(lambda p, t: sp.run_fn(p, t, key, **sp.state_kwargs), params,
                            t0._replace(nbrs=nbrs))
    cache[tag] = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    return cache[tag]


def trajstates_from_host(statepoints, params, meta: dict, leaves, mine, path) -> dict:
    """``{state point: [TrajState]}`` for the state points ``mine`` of
    ``statepoints`` from the saved ``leaves`` (see :func:`read`), checked
    leaf by leaf against states built at ``params``."""
    info = meta.get("trajstates") or {}
    saved = sorted(int(k) for k in info)
    absent = [i for i in mine if i not in saved]
    if absent or any(i >= len(statepoints) for i in saved):
        raise ckpt.CheckpointError(
            f"{path!r} holds trajectories of state point(s) {saved}; this trainer has "
            f"{len(statepoints)} state point(s) and needs {list(mine)}.")
    for i in saved:
        _check_saved(path, i, statepoints[i], info[f"{i:05d}"])
    cache = {}
    template = {f"{i:05d}": [_template(statepoints[i], params, c, ci, cache)
                             for c, ci in enumerate(info[f"{i:05d}"])] for i in saved}
    for i in saved:
        for ci, t in zip(info[f"{i:05d}"], template[f"{i:05d}"]):
            if ci.get("format", str(t.nbrs.format)) != str(t.nbrs.format):
                raise ckpt.CheckpointError(
                    f"{path!r} holds trajectories of state point {i} on a {ci['format']} "
                    f"neighbor list, but this trainer's neighbor_fn builds {t.nbrs.format} "
                    f"lists. Use the saved run's format, or sample new trajectories "
                    f"(initialize_trajstates()).")
    for i in saved:
        if len(info[f"{i:05d}"]) != statepoints[i].reference.shape[0]:
            raise ckpt.CheckpointError(
                f"{path!r} has {len(info[f'{i:05d}'])} chain(s) for state point {i}, this trainer "
                f"{statepoints[i].reference.shape[0]}.")
    host = ckpt.unflatten_like(template, leaves, meta["trees"]["trajstates"], "trajstates")
    return {i: [jax.tree.map(jnp.asarray, t) for t in host[f"{i:05d}"]] for i in mine}

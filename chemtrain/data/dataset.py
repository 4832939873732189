"""In-memory datasets: dicts of equal-length numpy arrays, one row per structure.

Conventions: ``R`` positions (n, atoms, 3) in nm, ``U`` energies (n,) in
kJ/mol, ``F`` forces (n, atoms, 3) in kJ/mol/nm, ``stress`` (n, 3, 3) in
kJ/mol/nm^3 (ASE's sign), optional ``mask`` (n, atoms) marking real atoms,
optional per-structure weights (n,) (``stress_weight``: 0 for structures
without a stress label), ``box`` (n, 3, 3) with the cell vectors as columns
(or (n, 3) / (n,) side lengths), precomputed graphs (``senders``,
``receivers`` (n, edges) and ``shifts`` (n, edges, 3), integers; see
:mod:`chemtrain.neighbors`), and any per-structure inputs of the energy
function (``species``, ...).
:func:`validate_dataset` holds a dataset to these shapes (a target that
would broadcast against the predictions is refused, not trained on), and
:func:`check_shapes` applies the same rules to an HDF5 file's datasets.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from ..layout import GRAPH_KEYS  # precomputed graphs (chemtrain.neighbors)

CHECK_FINITE = ("R", "U", "F", "stress", "box")
STRESS_WEIGHT = "stress_weight"


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_shapes(shapes: Mapping[str, tuple], n: int, name: str = "dataset",
                 weights: Iterable[str] = (), where: str = "memory") -> None:
    """Check the shapes of the standard keys against each other.

    ``shapes`` maps each key to its full shape ``(n, ...)``. ``R`` must be
    (n, atoms, 3), ``F`` exactly ``R``'s shape, ``U`` and every key in
    ``weights`` (n,), ``mask`` (n, atoms). A target whose shape differs from
    the prediction's would be broadcast into a wrong loss (``U`` of shape
    (n, 1) against predictions (n,) gives an (n, n) error), so it is refused.
    ``where`` ("memory" or "file") picks the fix the message suggests.
    """
    def fix(key, want):
        if where == "file":
            return f"rewrite the dataset {key!r} with shape {_fmt(want)}"
        dims = ", ".join(["-1", *(str(int(d)) for d in want[1:])])
        return f"data[{key!r}] = data[{key!r}].reshape({dims})"

    def refuse(key, want_text, want, got, why=""):
        size_ok = want is not None and int(np.prod(got)) == int(np.prod(want))
        hint = f" Fix: {fix(key, want)}." if size_ok else ""
        raise ValueError(f"{name}[{key!r}] must have shape {want_text}, got {_fmt(got)}.{why}{hint}")

    R = shapes.get("R")
    if R is not None and (len(R) != 3 or R[2] != 3):
        refuse("R", "(structures, atoms, 3)", None, R,
               " Positions are one (atoms, 3) array per structure; pad systems of different "
               "size with chemtrain.data.pad_systems.")
    if "F" in shapes:
        F = tuple(shapes["F"])
        if R is not None and F != tuple(R):
            why = ""
            if len(F) == 3 and F[1] == 1 and R[1] != 1:
                why = (" A single force row per structure would be broadcast to every atom "
                       "(atom 0's force copied to all).")
            refuse("F", f"(structures, atoms, 3) = {_fmt(R)}, the shape of R", R if
                   int(np.prod(F)) == int(np.prod(R)) else None, F, why)
        if R is None and (len(F) != 3 or F[2] != 3):
            refuse("F", "(structures, atoms, 3)", None, F)
    for key in ("U", *weights):
        if key in shapes and tuple(shapes[key]) != (n,):
            got = tuple(shapes[key])
            what = "one energy" if key == "U" else "one weight"
            why = (" An (n, 1) target against (n,) predictions broadcasts into an (n, n) "
                   "error and trains on a wrong loss." if len(got) == 2 and got[1] == 1 else "")
            refuse(key, f"(structures,) = {_fmt((n,))} ({what} per structure)", (n,), got, why)
    if "mask" in shapes and R is not None and tuple(shapes["mask"]) != tuple(R[:2]):
        refuse("mask", f"(structures, atoms) = {_fmt(R[:2])}", tuple(R[:2]), tuple(shapes["mask"]))
    if "stress" in shapes and tuple(shapes["stress"]) != (n, 3, 3):
        got = tuple(shapes["stress"])
        why = (" Voigt stresses (xx, yy, zz, yz, xz, xy) convert with "
               "ase.stress.voigt_6_to_full_3x3_stress." if got[1:] == (6,) else "")
        refuse("stress", f"(structures, 3, 3) = {_fmt((n, 3, 3))}", (n, 3, 3), got, why)
    if "box" in shapes and tuple(shapes["box"]) not in ((n,), (n, 3), (n, 3, 3)):
        refuse("box", f"(structures, 3, 3) = {_fmt((n, 3, 3))} (the cell vectors as columns), or "
                      f"side lengths (structures, 3) or (structures,)", None, tuple(shapes["box"]))
    graphs = [k for k in GRAPH_KEYS if k in shapes]
    if graphs:
        if len(graphs) != len(GRAPH_KEYS):
            raise ValueError(f"{name} has the graph key(s) {graphs} but not "
                             f"{[k for k in GRAPH_KEYS if k not in graphs]}; a precomputed graph "
                             f"needs all of {GRAPH_KEYS} (chemtrain.neighbors.add_graphs).")
        s = tuple(shapes["senders"])
        if len(s) != 2:
            refuse("senders", "(structures, edges)", None, s)
        if tuple(shapes["receivers"]) != s:
            refuse("receivers", f"(structures, edges) = {_fmt(s)}, the shape of senders", None,
                   tuple(shapes["receivers"]))
        if tuple(shapes["shifts"]) != (*s, 3):
            refuse("shifts", f"(structures, edges, 3) = {_fmt((*s, 3))}", None,
                   tuple(shapes["shifts"]))


def check_graph_values(data: Mapping, name: str = "dataset") -> None:
    """Integer graph arrays with indices in [0, atoms] (atoms: padding), and
    no cell shifts without a ``box`` to scale them."""
    if "senders" not in data:
        return
    atoms = data["R"].shape[1] if "R" in data else None
    for k in GRAPH_KEYS:
        if not np.issubdtype(data[k].dtype, np.integer):
            raise ValueError(f"{name}[{k!r}] must hold integers (edge indices or counts of cell "
                             f"vectors), got dtype {data[k].dtype}.")
    for k in ("senders", "receivers"):
        v = data[k]
        if atoms is not None and v.size and (v.min() < 0 or v.max() > atoms):
            raise ValueError(f"{name}[{k!r}] holds atom indices from {v.min()} to {v.max()}; they "
                             f"must lie in [0, {atoms}] ({atoms} marks a padded edge).")
    if "box" not in data and np.any(data["shifts"]):
        raise ValueError(f"{name} has non-zero cell shifts but no 'box' to turn them into "
                         f"vectors; add the cells (structures, 3, 3) as 'box'.")


def check_weights(values: np.ndarray, key: str, name: str = "dataset") -> None:
    """Per-structure weights must be real numbers, finite and >= 0."""
    values = np.asarray(values)
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"{name}[{key!r}] holds per-structure weights and must be numbers, got "
                         f"dtype {values.dtype}.")
    for bad, what in ((~np.isfinite(values), "NaN or inf"), (values < 0, "negative")):
        if bad.any():
            rows = np.nonzero(bad.reshape(-1))[0]
            raise ValueError(
                f"{name}[{key!r}] holds {rows.size} {what} weight(s), in structure(s) "
                f"{rows[:10].tolist()}{' ...' if rows.size > 10 else ''} (e.g. "
                f"{values.reshape(-1)[rows[0]].item()!r}). Per-structure weights must be finite and "
                f">= 0: use 0 to leave a structure out.")


def validate_dataset(data: Mapping, required: Iterable[str] = ("R",), name: str = "dataset",
                     weights: Iterable[str] = ()) -> dict:
    """Check a dataset and return it as a dict of numpy arrays.

    The dataset follows the conventions of :mod:`chemtrain.data.dataset`:
    one row per structure, ``R`` (n, atoms, 3) in nm, ``U`` (n,) in kJ/mol,
    ``F`` (n, atoms, 3) in kJ/mol/nm, ``stress`` (n, 3, 3) in kJ/mol/nm^3,
    ``mask`` (n, atoms), ``box`` (n, 3, 3), (n, 3) or (n,), and precomputed
    graphs ``senders``/``receivers`` (n, edges) and ``shifts`` (n, edges, 3).
    Every problem found raises an error that names it.

    Args:
      data: mapping of key -> array, every array with the same first
        (structure) axis.
      required: keys the dataset must have (default: positions ``R`` only).
      name: what to call the dataset in error messages.
      weights: keys of per-structure weights, shape (n,); those present in
        ``data`` must be finite and >= 0.

    Returns:
      A new dict with the same keys and every value as a numpy array
      (``np.asarray``: arrays that already are numpy arrays are not copied).

    Raises:
      TypeError: if ``data`` is not a mapping.
      ValueError: if a required key is missing; an entry is a single number
        (0-d); the arrays have unequal lengths; ``R``, ``U``, ``F``,
        ``stress`` or ``box`` does not hold numbers or holds NaN/inf; shapes
        do not match each other (see :func:`check_shapes`; e.g. ``U`` of
        shape (n, 1) is refused, not broadcast); per-structure weights are not
        numbers, not finite or negative; or the graph keys are incomplete,
        not integers, hold atom indices outside [0, atoms], or hold non-zero
        cell shifts without a ``box``.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{name} must be a dict of arrays with one row per structure "
                        f"(keys like 'R', 'U', 'F'), got {type(data).__name__}.")
    out = {k: np.asarray(v) for k, v in data.items()}
    weights = tuple(weights)
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"{name} lacks the key(s) {missing}; it has {sorted(out)}. "
                         f"'R' holds positions and each trained target needs its key "
                         f"(drop a target by leaving it out of gammas).")
    scalars = [k for k, v in out.items() if v.ndim == 0]
    if scalars:
        raise ValueError(f"{name}[{scalars[0]!r}] is a single number; every entry needs one row "
                         f"per structure (repeat it, e.g. np.full(n, value)).")
    lengths = {k: v.shape[0] for k, v in out.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{name} arrays must all have the same length (one row per "
                         f"structure), got lengths {lengths}.")
    for k in CHECK_FINITE:
        if k in out and not np.issubdtype(out[k].dtype, np.number):
            raise ValueError(f"{name}[{k!r}] must hold numbers, got dtype {out[k].dtype}.")
    n = next(iter(lengths.values()), 0)
    check_shapes({k: v.shape for k, v in out.items()}, n, name, weights)
    for k in CHECK_FINITE:
        if k in out and np.issubdtype(out[k].dtype, np.floating):
            bad = ~np.isfinite(out[k])
            if bad.any():
                rows = np.unique(np.nonzero(bad.reshape(bad.shape[0], -1))[0])
                raise ValueError(f"{name}['{k}'] holds {int(bad.sum())} NaN or inf value(s), "
                                 f"in structure(s) {rows[:10].tolist()}"
                                 f"{' ...' if rows.size > 10 else ''}. Remove or fix them.")
    for k in weights:
        if k in out:
            check_weights(out[k], k, name)
    check_graph_values(out, name)
    return out


def dataset_length(data: Mapping) -> int:
    """Number of structures of a dataset: the length of its first array.

    The other arrays are not looked at; :func:`validate_dataset` checks that
    all lengths agree.

    Args:
      data: mapping of key -> array with one row per structure.

    Returns:
      The first array's length along axis 0, as an int.

    Raises:
      StopIteration: if ``data`` has no entries.
    """
    return int(next(iter(data.values())).shape[0])


def split_dataset(data: Mapping, train_ratio: float = 0.7, val_ratio: float = 0.1,
                  shuffle: bool = False, seed: int = 0) -> dict[str, dict]:
    """Split a dataset into 'training', 'validation' and 'testing' parts by ratios.

    Of n structures, ``round(n * train_ratio)`` go to training, the next
    ``round(n * val_ratio)`` to validation and the rest to testing (which may
    be empty). Without ``shuffle`` the parts are consecutive rows in the
    original order. The dataset is not validated.

    Args:
      data: mapping of key -> numpy array with one row per structure.
      train_ratio: fraction of the structures for training, in (0, 1].
      val_ratio: fraction for validation, >= 0, with ``train_ratio +
        val_ratio <= 1``.
      shuffle: draw the rows of the parts in a random order (a permutation
        from ``numpy.random.default_rng(seed)``) instead of in order.
      seed: seed of that permutation; used only with ``shuffle``.

    Returns:
      ``{'training': part, 'validation': part, 'testing': part}``, each part a
      dict with ``data``'s keys holding the selected rows (copies).

    Raises:
      ValueError: if the ratios are out of range or add up to more than 1.
    """
    if not (0 < train_ratio <= 1 and 0 <= val_ratio and train_ratio + val_ratio <= 1 + 1e-12):
        raise ValueError(f"Need 0 < train_ratio <= 1, 0 <= val_ratio and train_ratio + "
                         f"val_ratio <= 1; got {train_ratio}, {val_ratio}.")
    n = dataset_length(data)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    n_train = int(round(n * train_ratio))
    n_val = int(round(n * val_ratio))
    parts = {"training": order[:n_train], "validation": order[n_train:n_train + n_val],
             "testing": order[n_train + n_val:]}
    return {stage: {k: v[idx] for k, v in data.items()} for stage, idx in parts.items()}


def pad_systems(systems: list[Mapping], n_atoms: int | None = None,
                per_atom: Iterable[str] = ("R", "F", "species"),
                pad_position: float | np.ndarray = 0.0) -> dict:
    """Stack structures of different size into one padded dataset.

    Per-atom arrays (``per_atom`` keys, atoms along their first axis) are
    padded to ``n_atoms`` atoms and a boolean ``mask`` (structures, atoms)
    marks real atoms. Padded positions are ``pad_position``; the padding of
    every other per-atom key (forces, species, ...) is 0. Other keys are
    stacked as they are, so they must have the same shape in every system.
    The keys are those of the first system.

    Args:
      systems: one mapping per structure, each with positions ``R`` (atoms,
        3) in nm and, e.g., forces ``F`` (atoms, 3) in kJ/mol/nm, ``species``
        (atoms,) and energy ``U`` (a number, kJ/mol).
      n_atoms: atoms per padded structure; default: the largest system.
      per_atom: the keys to pad along the atom axis.
      pad_position: position of the padded atoms (nm), a number or an array
        that broadcasts to (padded atoms, 3), such as a point (3,).

    Returns:
      A dict of stacked arrays with a leading structure axis; per-atom keys
      (structures, n_atoms, ...), other keys (structures, ...), and ``mask``
      (structures, n_atoms), True for real atoms (a ``mask`` of the systems
      is replaced).

    Raises:
      ValueError: if ``systems`` is empty, or ``n_atoms`` is smaller than the
        largest system.
    """
    if not systems:
        raise ValueError("pad_systems needs at least one system.")
    sizes = [np.asarray(s["R"]).shape[0] for s in systems]
    n_atoms = max(sizes) if n_atoms is None else n_atoms
    if max(sizes) > n_atoms:
        raise ValueError(f"n_atoms={n_atoms} is smaller than the largest system ({max(sizes)} atoms).")
    keys = list(systems[0])
    out = {}
    for k in keys:
        rows = []
        for s, size in zip(systems, sizes):
            v = np.asarray(s[k])
            if k in per_atom:
                fill = pad_position if k == "R" else 0
                pad = np.broadcast_to(np.asarray(fill, v.dtype), (n_atoms - size,) + v.shape[1:])
                v = np.concatenate([v, pad], axis=0)
            rows.append(v)
        out[k] = np.stack(rows)
    out["mask"] = np.arange(n_atoms)[None, :] < np.asarray(sizes)[:, None]
    return out

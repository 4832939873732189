"""jax-md neighbor lists with chemtrain's settings, carrying their cutoff.
See :mod:`chemtrain.neighbors`."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from .edges import _FORMATS, _box_matrix, check_minimum_image, perpendicular_widths

# ------------------------------------------------------- jax-md neighbor lists

def make_space(box=None, fractional_coordinates: bool = False):
    """``(displacement, shift)``: ``space.free()`` for ``box`` None, else
    ``space.periodic_general(box)`` (which also takes ``box=`` per call)."""
    from jax_md import space
    if box is None:
        return space.free()
    return space.periodic_general(jnp.asarray(_box_matrix(box)),
                                  fractional_coordinates=fractional_coordinates)


def neighbor_list(displacement_fn: Callable, box, cutoff: float, *, format: str = "sparse",
                  dr_threshold: float = 0.0, capacity_multiplier: float = 1.25,
                  fractional_coordinates: bool = False, cell_list: bool | None = None,
                  cell_list_min_atoms: int = 2048):
    """A jax-md neighbor list (``allocate``, ``update``) with the settings
    chosen here.

    ``box`` None means free space (no cell list: a cell list over a large
    dummy box allocates millions of cells); a periodic ``box`` (jax-md
    layout) must be at least ``2 * cutoff`` wide in every perpendicular
    direction (:class:`SmallCellError` otherwise; use :func:`add_graphs`
    for small cells). ``format``: 'sparse' (both directions of each pair, as
    MACE needs), 'dense' or 'ordered_sparse'. ``cell_list`` None decides at
    ``allocate``: on only for periodic boxes holding at least 3 cells per
    side and at least ``cell_list_min_atoms`` atoms (below that the all-pairs
    search is as fast). A list with a cell list cannot take a different
    ``box=`` per call unless ``fractional_coordinates``. ``box=`` given to
    ``allocate`` is checked too. The lists it allocates (and their
    updates) carry ``cutoff``: :func:`list_cutoff`, so that trainers and
    quantities can check what the list reaches.
    """
    from jax_md import partition
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {list(_FORMATS)}, got {format!r}.")
    fmt = getattr(partition, _FORMATS[format])
    if box is not None:
        check_minimum_image(box, cutoff, name="The box given to neighbor_list")
    built = {}

    def fns(n_atoms, box_now):
        side = box_now
        if box_now is not None and not fractional_coordinates:
            m = np.asarray(_box_matrix(box_now))   # jax-md's cell list takes side lengths here
            side = np.diag(m) if np.allclose(m, np.diag(np.diag(m))) else None
        use = cell_list
        if use is None:
            use = (side is not None and n_atoms >= cell_list_min_atoms and
                   bool(np.min(perpendicular_widths(box_now)) >= 3 * (cutoff + dr_threshold)))
        elif use and box_now is not None and side is None:
            raise ValueError("A cell list in a triclinic box needs fractional_coordinates=True "
                             "(jax-md); pass cell_list=False or fractional coordinates.")
        if use not in built:
            built[use] = partition.neighbor_list(
                displacement_fn, 1.0 if box_now is None else (side if use else box_now), cutoff,
                dr_threshold=dr_threshold, capacity_multiplier=capacity_multiplier, format=fmt,
                disable_cell_list=not use, fractional_coordinates=fractional_coordinates)
        return built[use]

    def allocate(positions, extra_capacity: int = 0, **kwargs):
        box_now = kwargs.get("box", box)
        if "box" in kwargs and not isinstance(kwargs["box"], jax.core.Tracer):
            check_minimum_image(kwargs["box"], cutoff, name="The box given to allocate")
        nbrs = fns(int(np.shape(positions)[0]), box_now).allocate(
            positions, extra_capacity=extra_capacity, **kwargs)
        return dataclasses.replace(nbrs, update_fn=_UpdateWithCutoff(nbrs.update_fn, cutoff))

    def update(positions, nbrs, **kwargs):
        return nbrs.update(positions, **kwargs)

    return partition.NeighborListFns(allocate, update)


class _UpdateWithCutoff:
    """The ``update_fn`` of a list from :func:`neighbor_list`: jax-md's,
    with the list's cutoff attached; every updated list carries it again.
    Compared by value (it is a static field of the list's pytree)."""

    def __init__(self, fn: Callable, cutoff: float):
        self.fn, self.cutoff = fn, float(cutoff)

    def __call__(self, positions, nbrs, **kwargs):
        out = self.fn(positions, nbrs, **kwargs)
        return dataclasses.replace(out, update_fn=self)

    def __eq__(self, other):
        return (isinstance(other, _UpdateWithCutoff) and other.fn is self.fn
                and other.cutoff == self.cutoff)

    def __hash__(self):
        return hash((id(self.fn), self.cutoff))


def list_cutoff(nbrs) -> float | None:
    """The distance up to which a jax-md neighbor list holds every pair: the
    cutoff a list from :func:`neighbor_list` carries, else the ``r_cutoff``
    of jax-md's own ``neighbor_list`` (its reach ``r_cutoff +
    dr_threshold`` minus the skin, which guards moving particles only),
    read from the closure of its update function (jax-md stores it nowhere
    else), else None (unknown)."""
    update_fn = getattr(nbrs, "update_fn", None)
    if isinstance(update_fn, _UpdateWithCutoff):
        return update_fn.cutoff
    closed = _jax_md_closure(update_fn)
    value = closed.get("cutoff")
    if not isinstance(value, (int, float, np.floating)):
        return None
    skin = 2.0 * float(np.sqrt(np.asarray(closed.get("threshold_sq", 0.0), np.float64)))
    return float(value) - skin


def list_box(nbrs):
    """The fixed box a jax-md ``neighbor_list`` was built with (jax-md's
    layout), or None: lists from :func:`neighbor_list` check theirs when
    built, and fractional or unknown lists give None."""
    closed = _jax_md_closure(getattr(nbrs, "update_fn", None))
    if closed.get("fractional_coordinates") or closed.get("box") is None:
        return None
    try:
        return np.asarray(closed["box"], np.float64)
    except (TypeError, jax.errors.TracerArrayConversionError):
        return None


def list_is_periodic(nbrs) -> bool | None:
    """Whether a jax-md neighbor list measures distances periodically (its
    metric wraps two points 10^6 apart), False for free space, None when
    unknown. A box given to a free-space list (jax-md asks for one) does
    not make it periodic."""
    update_fn = getattr(nbrs, "update_fn", None)
    if isinstance(update_fn, _UpdateWithCutoff):
        update_fn = update_fn.fn
    metric_sq = _jax_md_closure(update_fn).get("metric_sq")
    if not callable(metric_sq):
        return None
    try:
        d2 = float(np.asarray(metric_sq(jnp.zeros(3), jnp.full(3, 1.0e6))))
    except Exception:  # noqa: BLE001 - a metric wanting more arguments: unknown
        return None
    return not np.isclose(d2, 3.0e12)


def _jax_md_closure(update_fn) -> dict:
    """The variables jax-md's ``neighbor_list`` closes its update over."""
    if update_fn is None or isinstance(update_fn, _UpdateWithCutoff):
        return {}
    import inspect
    try:
        return dict(inspect.getclosurevars(update_fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def fixed_neighbor_list(idx, positions, format: str, cutoff: float):
    """A jax-md neighbor list holding edges found elsewhere (on the host):
    ``idx`` in jax-md's layout for ``format`` (``'sparse'`` and
    ``'ordered_sparse'``: (2, capacity); ``'dense'``: (atoms, capacity)),
    padded with the atom count. It records ``cutoff``
    (:func:`list_cutoff`) and refuses to be updated: its edges are only
    right for ``positions``."""
    from jax_md import partition
    return partition.NeighborList(
        idx=idx, reference_position=positions,
        error=partition.PartitionError(jnp.zeros((), jnp.uint8)), cell_list_capacity=None,
        max_occupancy=idx.shape[-1], format=getattr(partition, _FORMATS[format]), cell_size=None, cell_list_fn=None,
        update_fn=_UpdateWithCutoff(_refuse_update, cutoff))


def _refuse_update(positions, neighbor, **kwargs):
    raise NotImplementedError(
        "This neighbor list holds edges built on the host for fixed positions (e.g. by "
        "ChemtrainCalculator for each structure); it cannot be updated. Build a new one.")


"""jax-md neighbor lists with chemtrain's settings, carrying their cutoff.
See :mod:`chemtrain.neighbors`."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from .edges import FORMATS, box_matrix, check_minimum_image, perpendicular_widths

# ------------------------------------------------------- jax-md neighbor lists

def make_space(box=None, fractional_coordinates: bool = False):
    """A jax-md space ``(displacement, shift)`` for free space or a periodic box.

    Args:
      box: None for ``space.free()``; else a jax-md box in nm (a side length,
        (3,) side lengths or a (3, 3) matrix whose columns are the cell
        vectors) for ``space.periodic_general(box)``, whose functions also take
        ``box=`` per call.
      fractional_coordinates: passed to ``space.periodic_general`` (positions
        as fractions of the box); not used in free space.

    Returns:
      The tuple ``(displacement_fn, shift_fn)`` of jax-md functions.
    """
    from jax_md import space
    if box is None:
        return space.free()
    return space.periodic_general(jnp.asarray(box_matrix(box)),
                                  fractional_coordinates=fractional_coordinates)


def neighbor_list(displacement_fn: Callable, box, cutoff: float, *, format: str = "sparse",
                  dr_threshold: float = 0.0, capacity_multiplier: float = 1.25,
                  fractional_coordinates: bool = False, cell_list: bool | None = None,
                  cell_list_min_atoms: int = 2048):
    """A jax-md neighbor list (``allocate``, ``update``) with the settings chosen here.

    The settings are the list format, its capacity, the cell list on or off,
    and free space or periodic.

    Args:
      displacement_fn: jax-md displacement function of the simulation space.
      box: None for free space, where ``cell_list=None`` never turns the cell
        list on (a cell list over a large dummy box allocates millions of
        cells); or a periodic box in jax-md's layout, in nm, at least
        ``2 * cutoff`` wide in every perpendicular direction (use
        :func:`add_graphs` for smaller cells).
      cutoff: pair cutoff in nm.
      format: 'sparse' (both directions of each pair, as MACE needs), 'dense'
        or 'ordered_sparse'.
      dr_threshold: jax-md's skin in nm, added to the cutoff when the list is
        built.
      capacity_multiplier: jax-md's headroom factor on the capacity it
        allocates.
      fractional_coordinates: positions are fractions of the box (jax-md's
        ``periodic_general``). Needed for a cell list in a triclinic box, and
        for a list with a cell list to take a different ``box=`` per call.
      cell_list: True or False turns the cell list on or off. None decides at
        ``allocate``: on only for periodic boxes holding at least 3 cells per
        side (perpendicular widths at least ``3 * (cutoff + dr_threshold)``),
        orthorhombic unless ``fractional_coordinates``, and at least
        ``cell_list_min_atoms`` atoms (below that the all-pairs search is as
        fast).
      cell_list_min_atoms: the fewest atoms for which ``cell_list=None`` turns
        the cell list on.

    Returns:
      jax-md ``NeighborListFns`` of ``allocate(positions, extra_capacity=0,
      **kwargs)`` and ``update(positions, nbrs, **kwargs)``. A ``box=`` given to
      ``allocate`` is checked too (unless traced), and ``allocate`` raises
      :class:`SmallCellError` for one too small and ValueError for
      ``cell_list=True`` in a triclinic box without
      ``fractional_coordinates``. The lists it allocates (and their updates)
      carry ``cutoff``, read by :func:`list_cutoff`, so that trainers and
      quantities can check what the list reaches.

    Raises:
      ValueError: ``format`` is none of the three names.
      SmallCellError: ``box`` is narrower than ``2 * cutoff`` in some
        perpendicular direction (:func:`check_minimum_image`).
    """
    from jax_md import partition
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}.")
    fmt = getattr(partition, FORMATS[format])
    if box is not None:
        check_minimum_image(box, cutoff, name="The box given to neighbor_list")
    built = {}

    def fns(n_atoms, box_now):
        side = box_now
        if box_now is not None and not fractional_coordinates:
            m = np.asarray(box_matrix(box_now))   # jax-md's cell list takes side lengths here
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


#: the warning of :func:`list_cutoff` for a list whose cutoff cannot be read
UNKNOWN_CUTOFF = ("The cutoff of this neighbor list cannot be read (a jax-md list whose update "
                  "function does not close over 'cutoff': another jax-md version, or a list "
                  "built by hand), so the checks that it reaches the model's range and the "
                  "RDF/ADF's are skipped. Build lists with chemtrain.neighbors.neighbor_list, "
                  "which records its cutoff.")


def list_cutoff(nbrs) -> float | None:
    """The distance up to which a jax-md neighbor list holds every pair.

    Args:
      nbrs: jax-md ``NeighborList``.

    Returns:
      The cutoff (nm) that a list from :func:`neighbor_list` or
      :func:`fixed_neighbor_list` carries; else the ``r_cutoff`` of jax-md's
      own ``neighbor_list``, its reach ``r_cutoff + dr_threshold`` minus the
      skin (which guards moving particles only), read from the closure of its
      update function (jax-md stores it nowhere else); else None (unknown),
      with a warning (:data:`UNKNOWN_CUTOFF`): checks of what the list
      reaches are then skipped, and the user should know.
    """
    update_fn = getattr(nbrs, "update_fn", None)
    if isinstance(update_fn, _UpdateWithCutoff):
        return update_fn.cutoff
    closed = _jax_md_closure(update_fn)
    value = closed.get("cutoff")
    if not isinstance(value, (int, float, np.floating)):
        if update_fn is not None:
            warnings.warn(UNKNOWN_CUTOFF, UserWarning, stacklevel=2)
        return None
    skin = 2.0 * float(np.sqrt(np.asarray(closed.get("threshold_sq", 0.0), np.float64)))
    return float(value) - skin


def list_box(nbrs):
    """The fixed box a jax-md ``neighbor_list`` was built with, or None.

    The box is read from the closure of jax-md's update function.

    Args:
      nbrs: jax-md ``NeighborList``.

    Returns:
      The box as a float64 numpy array in jax-md's layout (nm), or None for
      lists from :func:`neighbor_list` (which check theirs when built), for
      lists in fractional coordinates and for lists whose box is unknown or
      traced.
    """
    closed = _jax_md_closure(getattr(nbrs, "update_fn", None))
    if closed.get("fractional_coordinates") or closed.get("box") is None:
        return None
    try:
        return np.asarray(closed["box"], np.float64)
    except (TypeError, jax.errors.TracerArrayConversionError):
        return None


def list_is_periodic(nbrs) -> bool | None:
    """Whether a jax-md neighbor list measures distances periodically.

    The list's metric is probed with two points 10^6 apart along each axis: a
    periodic metric wraps them closer. A box given to a free-space list (jax-md
    asks for one) does not make it periodic.

    Args:
      nbrs: jax-md ``NeighborList``, from jax-md or :func:`neighbor_list`.

    Returns:
      True for a periodic metric, False for free space, None when unknown (no
      metric in the update function's closure, or one that needs more
      arguments).
    """
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
    """A jax-md neighbor list holding edges found elsewhere (on the host).

    Args:
      idx: integer edge indices in jax-md's layout for ``format``, (2, capacity)
        for 'sparse' and 'ordered_sparse', (atoms, capacity) for 'dense';
        padded with the atom count.
      positions: (atoms, 3) positions in nm that the edges were found for (the
        list's ``reference_position``).
      format: 'sparse', 'dense' or 'ordered_sparse'.
      cutoff: the cutoff in nm the edges were found with, recorded for
        :func:`list_cutoff`.

    Returns:
      A jax-md ``NeighborList`` with ``max_occupancy = idx.shape[-1]``, no
      error bits set and no cell list. It refuses to be updated (its update
      raises NotImplementedError): its edges are only right for ``positions``.
    """
    from jax_md import partition
    return partition.NeighborList(
        idx=idx, reference_position=positions,
        error=partition.PartitionError(jnp.zeros((), jnp.uint8)), cell_list_capacity=None,
        max_occupancy=idx.shape[-1], format=getattr(partition, FORMATS[format]), cell_size=None, cell_list_fn=None,
        update_fn=_UpdateWithCutoff(_refuse_update, cutoff))


def _refuse_update(positions, neighbor, **kwargs):
    raise NotImplementedError(
        "This neighbor list holds edges built on the host for fixed positions (e.g. by "
        "ChemtrainCalculator for each structure); it cannot be updated. Build a new one.")


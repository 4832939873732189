"""What a trainer needs to know about an energy model, said explicitly.

An energy template is ``params -> energy_fn(positions, neighbor, **kwargs)``.
Models that need more from a trainer wrap theirs in :class:`EnergyTemplate`
with named fields, instead of attributes set on a function (which a typo
silently ignores).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class EnergyTemplate:
    """An energy template plus what trainers must know about it.

    A frozen dataclass; calling it calls ``fn``. Plain callables become one
    through :func:`as_template`.

    Args:
      fn: the template proper, ``params -> energy_fn(positions, neighbor,
        **kwargs)``; ``energy_fn`` maps positions (N, 3) in nm to the total
        potential energy (a scalar, kJ/mol).
      check_vma: whether shard_map's varying-axis check can stay on under
        ``parallelism='jax'`` (False for models whose primitives lose the
        varying type, such as MACE on cuequivariance-jax 0.13).
      validate_dataset: ``data -> None``, raising on data the model cannot
        use (unknown elements, missing species); trainers call it when a
        dataset is set. None: no check.
      cutoff: the range of the model in nm: pairs farther apart contribute
        nothing. Trainers refuse a neighbor list that holds pairs only up to
        a shorter distance (the pairs in between would be lost silently).
        None: unknown, not checked.
      periodic: False for a model built on free space (``space.free()``),
        which trainers refuse in a periodic simulation; True for one known to
        be built on a periodic displacement function; None: unknown.
      batched: optional ``params -> energies(positions, neighbor, **kwargs)``
        for a batch of structures: positions (B, N, 3), ``neighbor`` a
        :class:`~chemtrain.neighbors.Graph` of (B, E) arrays or a jax-md
        list with a leading axis B, and every keyword with the leading axis
        B; returns (B,) energies, each what ``fn(params)`` gives for that
        structure. Force matching on graphs and DiffTRe's energies of
        snapshots use it instead of a ``jax.vmap`` of ``fn(params)`` (MACE's
        evaluates the batch as one disjoint graph, as mace-torch does).
        None: the vmap.
    """
    fn: Callable
    check_vma: bool = True
    validate_dataset: Callable[[Mapping], None] | None = None
    cutoff: float | None = None
    periodic: bool | None = None
    batched: Callable | None = None

    def __call__(self, params):
        """Build the energy function for ``params``.

        Args:
          params: the model's parameters (any pytree ``fn`` accepts).

        Returns:
          ``fn(params)``, the energy function ``energy_fn(positions, neighbor,
          **kwargs)``.
        """
        return self.fn(params)


def as_template(template) -> EnergyTemplate:
    """Return ``template`` as an :class:`EnergyTemplate`.

    An :class:`EnergyTemplate` is returned unchanged. A plain callable becomes
    one with the defaults (``check_vma=True``, no dataset check, unknown
    cutoff and periodicity). A callable carrying attributes (the old
    ``template.check_vma = False`` style, or a typo of it) is refused, since
    nothing would read them.

    Args:
      template: an :class:`EnergyTemplate`, or a callable ``params ->
        energy_fn(positions, neighbor, **kwargs)`` without attributes of its
        own.

    Returns:
      The :class:`EnergyTemplate`.

    Raises:
      TypeError: if ``template`` is not callable, or if it carries attributes
        (other than dunder ones) in its ``__dict__``.
    """
    if isinstance(template, EnergyTemplate):
        return template
    if not callable(template):
        raise TypeError(f"energy_fn_template must be callable (params -> energy_fn), got "
                        f"{type(template).__name__}.")
    extra = sorted(k for k in getattr(template, "__dict__", {}) if not k.startswith("__"))
    if extra:
        raise TypeError(
            f"energy_fn_template carries the attribute(s) {extra}, which trainers do not read. "
            f"Say what the trainer must know explicitly: chemtrain.models.EnergyTemplate(fn, "
            f"check_vma=..., validate_dataset=...).")
    return EnergyTemplate(template)


def is_free_space(displacement_fn) -> bool | None:
    """Whether ``displacement_fn`` is free space (it returns the plain
    difference of two points 10^6 apart; a periodic one wraps it); None
    when it cannot be called without more arguments (or is None)."""
    if displacement_fn is None:
        return None
    import jax.numpy as jnp
    import numpy as np
    try:
        d = np.asarray(displacement_fn(jnp.zeros(3), jnp.full(3, 1.0e6)))
    except Exception:  # noqa: BLE001 - e.g. periodic_general wanting box=
        return None
    return bool(np.allclose(d, -1.0e6))


def check_reach(template, nbrs, where: str, periodic_box: bool = False) -> None:
    """Refuse a neighbor list that holds fewer pairs than the model's range,
    and a free-space model in a periodic simulation (a list whose metric is
    periodic, or ``periodic_box``)."""
    template = as_template(template)
    if nbrs is None or not hasattr(nbrs, "idx"):
        return
    from ..neighbors import list_cutoff, list_is_periodic
    check_range(template, list_cutoff(nbrs), where)
    if template.periodic is False and (periodic_box or list_is_periodic(nbrs)):
        raise ValueError(
            f"{where}: the energy model was built on free space (space.free()), but the "
            f"simulation is periodic, so pairs across the box edge would be missed. Build the "
            f"model with the simulation's displacement function (space.periodic or "
            f"space.periodic_general).")


def check_range(template, reach: float | None, where: str, fix: str | None = None) -> None:
    """Refuse neighbors that reach only ``reach`` nm for a model whose range
    (:attr:`EnergyTemplate.cutoff`) is longer: the pairs in between would be
    lost silently. Either unknown (None): nothing to compare. ``fix``: the
    message's last sentence (default: build a longer neighbor list)."""
    cutoff = as_template(template).cutoff
    if cutoff is None or reach is None or cutoff <= reach * (1 + 1e-6) + 1e-12:
        return
    fix = fix or (f"Build the neighbor list with a cutoff of at least {cutoff:g} nm (or use a "
                  f"model of shorter range).")
    raise ValueError(f"{where}: the energy model reaches {cutoff:g} nm, but the neighbor list "
                     f"holds pairs only up to {reach:g} nm, so the pairs in between would be "
                     f"left out without a word. {fix}")


def periodic(displacement_fn) -> bool | None:
    """:attr:`EnergyTemplate.periodic` of a model on ``displacement_fn``."""
    free = is_free_space(displacement_fn)
    return None if free is None else not free

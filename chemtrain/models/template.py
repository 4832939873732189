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

    Args:
      fn: ``params -> energy_fn(positions, neighbor, **kwargs)``.
      check_vma: whether shard_map's varying-axis check can stay on under
        ``parallelism='jax'`` (False for models whose primitives lose the
        varying type, such as MACE on cuequivariance-jax 0.13).
      validate_dataset: ``data -> None``, raising on data the model cannot
        use (unknown elements, missing species); trainers call it when a
        dataset is set.
    """
    fn: Callable
    check_vma: bool = True
    validate_dataset: Callable[[Mapping], None] | None = None

    def __call__(self, params):
        return self.fn(params)


def as_template(template) -> EnergyTemplate:
    """Return ``template`` as an :class:`EnergyTemplate`.

    A plain callable becomes one with the defaults. A callable carrying
    attributes (the old ``template.check_vma = False`` style, or a typo of
    it) is refused, since nothing would read them.
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

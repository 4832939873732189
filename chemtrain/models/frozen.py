"""Freezing named blocks of a model's parameters.

:func:`freeze` wraps an optax optimizer so that the named entries get zero
updates (``optax.multi_transform`` with ``optax.set_to_zero``) and stay
bitwise unchanged. Entries are named by their path in the parameter tree,
dict keys and list indices joined by dots: ``"prior"``, ``"embedding"``,
``"interactions.0"`` (the first interaction of a MACE),
``"readouts.1.linear_2"``. :func:`block_names` lists what can be named.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import optax


def _parts(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def block_names(params, depth: int = 2) -> list[str]:
    """The names :func:`freeze` accepts, down to ``depth`` levels.

    Args:
      params: a parameter pytree.
      depth: how many levels of dict keys and list indices to name.

    Returns:
      The names in tree order, e.g. ``['embedding', 'interactions',
      'interactions.0', ...]`` for a MACE.
    """
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = _parts(path)
        for d in range(1, min(depth, len(parts)) + 1):
            name = ".".join(parts[:d])
            if name not in names:
                names.append(name)
    return names


def labels(params, frozen: Sequence[str]):
    """The tree of ``params``' structure with ``"frozen"`` at every leaf
    under a name in ``frozen`` and ``"trained"`` elsewhere.

    Raises:
      ValueError: a name that names no entry of ``params``.
    """
    wanted = {name: tuple(name.split(".")) for name in frozen}
    used = set()

    def label(path, _):
        parts = _parts(path)
        hit = [n for n, w in wanted.items() if parts[:len(w)] == w]
        used.update(hit)
        return "frozen" if hit else "trained"
    tree = jax.tree_util.tree_map_with_path(label, params)
    unknown = [n for n in frozen if n not in used]
    if unknown:
        top = sorted({n.split(".")[0] for n in block_names(params, 1)})
        raise ValueError(f"freeze: {unknown} are not entries of the parameters {top} (name "
                         f"deeper blocks with dots, e.g. {block_names(params, 2)[:6]}).")
    return tree


def freeze(optimizer: optax.GradientTransformation, params: Mapping,
           frozen: Sequence[str] | str) -> optax.GradientTransformation:
    """Wrap an optimizer so that the named entries of the parameters stay fixed.

    The entries of ``params`` not named in ``frozen`` are updated by
    ``optimizer``; the named ones get zero updates (``optax.multi_transform``
    with ``optax.set_to_zero``), so they stay bitwise unchanged, whatever
    the optimizer (weight decay included). Examples:
    ``freeze(optax.adam(1e-3), params, ["prior"])``;
    ``freeze(opt, mace_params, ["embedding", "interactions.0", "products.0"])``.

    Args:
      optimizer: the optax optimizer of the trained entries.
      params: the parameter dict that will be optimized (its structure is
        used, not its values).
      frozen: names of entries of ``params``, dict keys and list indices
        joined by dots (see :func:`block_names`); one name may be given as a
        string.

    Returns:
      An ``optax.GradientTransformation``. Its ``init`` and ``update`` raise
      ``ValueError`` if the parameters or updates they receive do not have
      the structure of ``params`` (a committee's stacked parameters have).

    Raises:
      ValueError: if ``params`` is not a mapping, if an entry of ``frozen`` is
        not a string, or if a name in ``frozen`` names no entry of ``params``.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"freeze: params must be the dict of the parameters whose entries "
                         f"are frozen or trained, got {type(params).__name__}.")
    if isinstance(frozen, str):
        frozen = [frozen]
    if not all(isinstance(k, str) and k for k in frozen):
        raise ValueError(f"freeze: frozen must be names of entries of the parameters "
                         f"{sorted(params)}, got {frozen!r}.")
    tree = labels(params, list(frozen))
    structure = jax.tree.structure(tree)
    inner = optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, tree)

    def check(given, what):
        keys = sorted(given) if isinstance(given, Mapping) else None
        if keys != sorted(params):
            got = keys if keys is not None else type(given).__name__
            raise ValueError(f"freeze was built on the parameters with entries {sorted(params)}, "
                             f"but the {what} have {got}. Build it on the parameters it trains: "
                             f"freeze(optimizer, those_params, {list(frozen)!r}).")
        if jax.tree.structure(given) != structure:
            raise ValueError(f"freeze was built on parameters of another structure than the "
                             f"{what}: {structure} against {jax.tree.structure(given)}. Build "
                             f"it on the parameters it trains.")

    def init(params):
        check(params, "parameters")
        return inner.init(params)

    def update(updates, state, params=None):
        check(updates, "updates")
        return inner.update(updates, state, params)
    return optax.GradientTransformation(init, update)

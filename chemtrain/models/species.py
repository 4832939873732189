"""Atomic numbers and a model's elements, shared by every architecture
(MACE, NequIP): the lookup from atomic number to the model's element index
and the dataset check that names unknown elements."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class UnknownElementError(ValueError):
    """A structure holds an element that the model was not trained on.

    A ``ValueError``. Raised by :func:`check_species` (also for atomic numbers
    that are not integers) and so by the dataset check of every model's
    energy template.
    """


def element_table(atomic_numbers: Sequence[int]) -> np.ndarray:
    """Lookup table from atomic number to the model's element index.

    Args:
      atomic_numbers: the model's elements, in the order of its parameters.

    Returns:
      An int32 array of shape (119,) whose entry Z is the index of atomic
      number Z in ``atomic_numbers``, or -1 if the model does not know Z.
    """
    table = np.full(119, -1, np.int32)
    table[list(atomic_numbers)] = np.arange(len(atomic_numbers))
    return table


def with_symbols(numbers) -> str:
    """``[9, 17]`` -> ``'9 (F), 17 (Cl)'``."""
    from ase.data import chemical_symbols
    return ", ".join(f"{z} ({chemical_symbols[z]})" if 0 < z < len(chemical_symbols) else str(z)
                     for z in numbers)


def check_species(atomic_numbers: Sequence[int], species, mask=None, *, model: str,
                  what: str = "The dataset has",
                  fix: str = "Remove those structures or use a model trained on these "
                             "elements.") -> None:
    """Check that every real atom's element is one the model knows.

    Args:
      atomic_numbers: the model's elements.
      species: integer atomic numbers, any shape (e.g. (n_structures, N));
        None is refused.
      mask: bool array of the shape of ``species``, True for real atoms
        (padding is False and not checked); None: every atom is real.
      model: the architecture's name in the messages ('MACE', 'NequIP').
      what: start of the error message, before the unknown atomic numbers.
      fix: end of the error message (what to do).

    Raises:
      ValueError: if ``species`` is None (the dataset has no ``'species'``).
      UnknownElementError: if ``species`` is not of an integer dtype, or a real
        atom's atomic number is not one of ``atomic_numbers``; the message
        starts with ``what``, names the unknown atomic numbers with their
        chemical symbols, and ends with ``fix``.
    """
    if species is None:
        raise ValueError(f"The {model} model needs per-atom atomic numbers: add a 'species' array "
                         "(structures x atoms, integers) to the dataset.")
    z = np.asarray(species)
    real = np.ones(z.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if not np.issubdtype(z.dtype, np.integer):
        raise UnknownElementError(f"species must be integer atomic numbers, got dtype {z.dtype}.")
    bad = np.unique(z[real & ~np.isin(z, list(atomic_numbers))])
    if bad.size:
        raise UnknownElementError(
            f"{what} atomic numbers {with_symbols(bad.tolist())} that the {model} model does not "
            f"know; it was built for {list(atomic_numbers)}. {fix}")

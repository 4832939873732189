"""``list_cutoff`` reads the cutoff a list carries; a jax-md list whose cutoff
cannot be read is warned about, never skipped silently (issue 32)."""
import dataclasses

import numpy as np
import pytest
from jax_md import partition, space

from chemtrain.neighbors import list_cutoff, neighbor_list


def _positions():
    return np.random.default_rng(0).uniform(0, 2.0, (20, 3))


def test_our_lists_carry_their_cutoff_and_jax_md_lists_are_read():
    displacement, _ = space.periodic(2.0)
    ours = neighbor_list(displacement, 2.0, 0.6).allocate(_positions())
    assert list_cutoff(ours) == pytest.approx(0.6)
    theirs = partition.neighbor_list(displacement, 2.0, 0.6, dr_threshold=0.1).allocate(
        _positions())
    assert list_cutoff(theirs) == pytest.approx(0.6)


def test_a_list_whose_cutoff_cannot_be_read_is_warned_about():
    displacement, _ = space.periodic(2.0)
    nbrs = partition.neighbor_list(displacement, 2.0, 0.6).allocate(_positions())
    inner = nbrs.update_fn
    hidden = dataclasses.replace(nbrs, update_fn=lambda R, nb, **kw: inner(R, nb, **kw))
    with pytest.warns(UserWarning, match="cutoff of this neighbor list cannot be read"):
        assert list_cutoff(hidden) is None

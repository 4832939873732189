"""chemtrain.neighbors: edges of every periodic image found on the host
(against a brute-force image search), precomputed graphs, the jax-md
neighbor-list helper and its settings, fixed lists of host edges, and the
minimum-image error for cells too small for a jax-md list."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, space

from cells_ref import brute_edges, lj_data
from chemtrain import neighbors as nb
from chemtrain.models import lennard_jones_template
from chemtrain.trainers import ForceMatching, RunOptions


# ------------------------------------------------------------- host graphs

@pytest.mark.parametrize("backend", ["matscipy", "ase"])
def test_host_edges_are_every_image(backend):
    rng = np.random.default_rng(0)
    tri = np.array([[3.0, 0, 0], [1.2, 2.9, 0], [0.7, -0.6, 3.3]])
    slab = np.array([[3.1, 0, 0], [0.5, 3.0, 0], [0, 0, 0]])          # no third vector
    cases = [(rng.uniform(0, 5, (7, 3)), np.zeros((3, 3)), [False] * 3),  # molecule
             (np.array([[0.1, 0.1, 0.1], [1.5, 1.5, 1.5]]), np.eye(3) * 2.8, [True] * 3),
             (rng.uniform(-0.3, 1.3, (5, 3)) @ tri, tri, [True] * 3),  # atoms outside the cell
             (rng.uniform(0, 1, (6, 3)) @ np.diag([3.0, 3.0, 6.0]) + [5, -7, 30], slab,
              [True, True, False])]
    for pos, cell, pbc in cases:
        i, j, S = nb.host_edges(pos, cell, pbc, 4.0, backend)
        got = {(int(a), int(b), tuple(int(x) for x in s)) for a, b, s in zip(i, j, S)}
        assert len(got) == len(i) and got == brute_edges(pos, cell, pbc, 4.0)


def test_precompute_graphs_pads_and_masks():
    R = np.zeros((2, 4, 3))
    R[:, :3] = [[0.0, 0, 0], [0.1, 0, 0], [0.0, 0.12, 0]]
    R[0, 3] = [0.05, 0.05, 0]              # a padded atom next to the others
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], bool)
    box = np.stack([np.zeros((3, 3)), np.eye(3) * 0.25])   # a molecule and a 0.25 nm cell
    g = nb.precompute_graphs(R, box, 0.3, mask=mask)
    assert g["senders"].shape == g["receivers"].shape and g["shifts"].shape[2] == 3
    assert g["senders"].dtype == np.int32 and np.issubdtype(g["shifts"].dtype, np.integer)
    real = g["senders"] < 4
    assert real[0].sum() == 6 and not (g["shifts"][0] != 0).any()     # 3 atoms, both directions
    assert real[1].sum() > 6 * 10                                       # many images
    assert (g["senders"][~real] == 4).all() and (g["receivers"][~real] == 4).all()
    assert not ((g["senders"] == 3) | (g["receivers"] == 3)).any()     # padded atom: no edges
    with pytest.raises(ValueError, match=r"Structure 1 has \d+ edges, more than capacity=10"):
        nb.precompute_graphs(R, box, 0.3, mask=mask, capacity=10)


def test_neighbor_list_helper_chooses_settings():
    rng = np.random.default_rng(0)
    R = jnp.asarray(rng.uniform(0, 1.0, (40, 3)))
    disp, _ = nb.make_space(None)                      # a molecule: never a cell list
    nbrs = nb.neighbor_list(disp, None, 0.3).allocate(R)
    assert nbrs.cell_list_fn is None and nb.list_cutoff(nbrs) == 0.3
    s, r, _, real = nb.edge_vectors(disp, R, nbrs)
    got = {(int(a), int(b)) for a, b, m in zip(s, r, real) if m}
    d = np.linalg.norm(np.asarray(R)[:, None] - np.asarray(R)[None], axis=-1)
    assert got == {(int(i), int(j)) for i, j in zip(*np.nonzero((d < 0.3) & (d > 0)))}
    # periodic: a cell list only for enough atoms and at least 3 cells per side
    box = np.eye(3) * 1.0
    disp, _ = nb.make_space(box)
    assert nb.neighbor_list(disp, box, 0.3).allocate(R).cell_list_fn is None
    many = nb.neighbor_list(disp, box, 0.3, cell_list_min_atoms=40).allocate(R)
    assert many.cell_list_fn is not None
    s, r, vec, real = nb.edge_vectors(disp, R, many)
    dv = np.asarray(R)[None] - np.asarray(R)[:, None]
    d = np.linalg.norm(dv - np.round(dv), axis=-1)
    got = {(int(a), int(b)) for a, b, m in zip(s, r, real) if m}
    assert got == {(int(i), int(j)) for i, j in zip(*np.nonzero((d < 0.3) & (d > 0)))}
    assert nb.neighbor_list(disp, box, 0.35, cell_list_min_atoms=40).allocate(R).cell_list_fn is None


def test_fixed_neighbor_list_keeps_cutoff_and_format_and_refuses_updates():
    R = jnp.asarray([[0.0, 0, 0], [0.1, 0, 0], [0.0, 0.12, 0]])
    pairs = jnp.asarray([[0, 1, 1, 2, 3], [1, 0, 2, 1, 3]], jnp.int32)   # padded with 3 atoms
    ordered = jnp.asarray([[0, 1, 3], [1, 2, 3]], jnp.int32)
    dense = jnp.asarray([[1, 3], [0, 2], [1, 3]], jnp.int32)
    for fmt, cls, idx in (("sparse", partition.Sparse, pairs), ("dense", partition.Dense, dense),
                          ("ordered_sparse", partition.OrderedSparse, ordered)):
        nbrs = nb.fixed_neighbor_list(idx, R, fmt, 0.3)
        assert isinstance(nbrs, partition.NeighborList) and nbrs.format == cls, fmt
        assert nb.list_cutoff(nbrs) == 0.3
        np.testing.assert_array_equal(nbrs.idx, idx)
        with pytest.raises(NotImplementedError, match="cannot be updated"):
            nbrs.update(R)


# ---------------------------------------------------- the minimum-image error

def test_small_cell_with_jax_md_list_is_refused(tmp_path):
    disp, _ = space.periodic_general(np.eye(3) * 0.5, fractional_coordinates=False)
    # the helper refuses the cell when it is built, naming widths and cutoff
    with pytest.raises(nb.SmallCellError, match=r"perpendicular widths \[0\.5 +0\.5 +0\.5\] nm.*"
                                                 r"twice the cutoff \(0\.4 nm"):
        nb.neighbor_list(disp, np.eye(3) * 0.5, 0.4)
    tri = np.array([[1.0, 0.0, 0.0], [0.9, 0.3, 0.0], [0.0, 0.0, 1.0]]).T   # 0.29 nm between faces
    with pytest.raises(nb.SmallCellError, match=r"widths \[0\.3162 0\.3 +1\. +\] nm"):
        nb.neighbor_list(disp, tri, 0.2)
    # a plain jax-md list: the trainer refuses the data's cells (its cutoff 0.4 nm; the
    # 0.05 nm skin only guards moving particles, so the list surely holds pairs to 0.4 nm)
    nbrs = partition.neighbor_list(disp, np.eye(3) * 0.5, 0.4, dr_threshold=0.05,
                                   format=partition.Sparse, disable_cell_list=True
                                   ).allocate(jnp.asarray(lj_data()["R"][0]))
    assert nb.list_cutoff(nbrs) == pytest.approx(0.4)
    tr = ForceMatching({"sigma": 0.3, "epsilon": 1.0}, optax.sgd(1e-3),
                       lennard_jones_template(disp, 0.4), nbrs, batch=2, parallelism="single",
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    with pytest.raises(nb.SmallCellError, match=r"structure\(s\), first \[0, 1, 2, 3\]\) has "
                                                 r"perpendicular widths \[0\.5 +0\.5 +0\.5\] nm"):
        tr.set_datasets(lj_data(), train_ratio=1.0, val_ratio=0.0)
    tr.set_datasets(lj_data(box=1.0), train_ratio=1.0, val_ratio=0.0)   # wide enough: fine
    # from a file too (the trainer reads the box column)
    from chemtrain.data import HDF5ParallelDataLoader
    from problems import write_h5
    h5 = write_h5(tmp_path / "small.h5", lj_data())
    with pytest.raises(nb.SmallCellError, match="the training loader's data"):
        tr.set_loader(HDF5ParallelDataLoader(h5), "training")
    # slabs cannot go through a jax-md list either
    slab = dict(lj_data(box=1.0), pbc=np.tile([True, True, False], (4, 1)))
    with pytest.raises(nb.SmallCellError, match=r"periodic along \[True, True, False\] only"):
        tr.set_datasets(slab, train_ratio=1.0, val_ratio=0.0)

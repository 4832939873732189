"""Periodic cells and molecules for the materials, neighbor and converter
tests: a brute-force image search (the reference for edges), small
Lennard-Jones data sets and argon structures, and the project's
Lennard-Jones template on precomputed graphs."""
from __future__ import annotations

import itertools

import numpy as np

from chemtrain.models import lennard_jones_template


def brute_edges(pos, cell, pbc, cutoff):
    reps = [range(-6, 7) if p else [0] for p in pbc]
    out = set()
    for S in itertools.product(*reps):
        d = pos[None, :, :] - pos[:, None, :] + np.array(S) @ cell
        for i, j in zip(*np.nonzero(np.linalg.norm(d, axis=-1) < cutoff)):
            if i != j or any(S):
                out.add((int(i), int(j), S))
    return out


def lj_data(n=4, box=0.5):
    rng = np.random.default_rng(0)
    R = rng.uniform(0, box, (n, 4, 3))
    return {"R": R, "U": np.zeros(n), "F": np.zeros_like(R), "box": np.tile(np.eye(3) * box, (n, 1, 1))}


# --------------------------------------------------- Lennard-Jones with stress

SIGMA, EPSILON, RC, RO = 3.4, 0.0104, 7.0, 6.0      # Angstrom, eV (argon-like)


# the project's LJ on precomputed graphs (no displacement function needed)
LJ_GRAPHS = lennard_jones_template(None, RC * 0.1, RO * 0.1)


def lj_crystals(n, seed):
    """Strained, disturbed argon fcc cells of 1 and 4 atoms (3-5 A wide)."""
    from ase.build import bulk
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        atoms = bulk("Ar", "fcc", a=5.3 * rng.uniform(0.97, 1.05), cubic=bool(k % 2))
        strain = np.eye(3) + 0.03 * rng.normal(size=(3, 3))
        cell = atoms.cell.array @ strain
        pos = atoms.positions @ strain + 0.1 * rng.normal(size=atoms.positions.shape)
        out.append((pos, cell, [True] * 3))
    return out


def lj_molecules(n, seed):
    """Argon triangles (no cell)."""
    rng = np.random.default_rng(seed)
    tri = np.array([[0.0, 0, 0], [3.8, 0, 0], [1.9, 3.3, 0]])
    return [(tri + rng.normal(0, 0.15, (3, 3)), np.zeros((3, 3)), [False] * 3) for _ in range(n)]

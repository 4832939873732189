"""Which uncertain frames to label: a diverse subset, not only the top scores.

Frames of one molecular-dynamics burst that pass the threshold together are
often near-duplicates; labelling all of them spends the oracle's time on one
configuration. :func:`diverse` picks by farthest-point sampling in a
structural fingerprint (:func:`fingerprints`): the most uncertain frame
first, then each time the candidate farthest from everything already picked
and from the training set.
"""
from __future__ import annotations

import numpy as np

#: the fingerprint's distance histogram: range (Angstrom), bins, Gaussian width (Angstrom)
RANGE, BINS, WIDTH = 6.0, 24, 0.15


def pairs_of(frames) -> list[tuple[int, int]]:
    """The element pairs ``(Z_i <= Z_j)`` of all ``frames``, sorted."""
    z = sorted({int(n) for a in frames for n in a.numbers})
    return [(a, b) for i, a in enumerate(z) for b in z[i:]]


def fingerprints(frames, pairs=None) -> np.ndarray:
    """One vector per frame: for each element pair, the histogram of
    interatomic distances up to :data:`RANGE` (periodic images included),
    smoothed by a Gaussian of :data:`WIDTH` and divided by the number of
    atoms. Frames of one configuration up to small thermal motion are close;
    another phase, a surface or another composition is far.

    Args:
      frames: ``ase.Atoms``.
      pairs: the element pairs to use (default :func:`pairs_of` of ``frames``);
        give the same pairs to compare fingerprints of different calls.
    """
    from ase.neighborlist import neighbor_list
    pairs = pairs_of(frames) if pairs is None else list(pairs)
    index = {p: k for k, p in enumerate(pairs)}
    centres = (np.arange(BINS) + 0.5) * RANGE / BINS
    out = np.zeros((len(frames), len(pairs) * BINS))
    for f, atoms in enumerate(frames):
        i, j, d = neighbor_list("ijd", atoms, RANGE)
        zi, zj = atoms.numbers[i], atoms.numbers[j]
        key = np.stack([np.minimum(zi, zj), np.maximum(zi, zj)], 1)
        smooth = np.exp(-0.5 * ((d[:, None] - centres[None]) / WIDTH) ** 2)
        for p, k in index.items():
            rows = (key[:, 0] == p[0]) & (key[:, 1] == p[1])
            out[f, k * BINS:(k + 1) * BINS] = smooth[rows].sum(0) / len(atoms)
    return out


def diverse(scores, features, n: int, covered=None) -> list[int]:
    """Farthest-point sampling of ``n`` of the candidates.

    Args:
      scores: (m,) uncertainty of each candidate; the first pick is the largest.
      features: (m, d) their fingerprints.
      n: how many to pick (at most m are returned).
      covered: (c, d) fingerprints already in the training set (optional):
        a candidate close to one of them counts as covered.

    Returns:
      Indices into the candidates, in the order picked. Ties go to the
      higher score.
    """
    scores = np.asarray(scores, float)
    features = np.asarray(features, float)
    m = len(scores)
    if m == 0 or n <= 0:
        return []
    order = np.argsort(-scores, kind="stable")
    picked = [int(order[0])]
    nearest = np.linalg.norm(features - features[picked[0]], axis=1)
    if covered is not None and len(covered):
        base = np.min(np.linalg.norm(features[:, None] - np.asarray(covered)[None], axis=-1), 1)
        nearest = np.minimum(nearest, base)
    while len(picked) < min(n, m):
        gap = nearest.copy()
        gap[picked] = -np.inf
        best = np.flatnonzero(gap == gap.max())
        k = int(best[np.argmax(scores[best])])
        picked.append(k)
        nearest = np.minimum(nearest, np.linalg.norm(features - features[k], axis=1))
    return picked

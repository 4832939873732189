"""Reference mace-torch models and structures for the MACE tests.

Builds random-initialised ``ScaleShiftMACE`` models (mace-torch, real code)
in three configurations, saves them with ``torch.save`` like a ``.model``
file, and evaluates energies and forces with mace-torch's ASE calculator.
"""
from __future__ import annotations

import os

import numpy as np

CONFIGS = {
    # an L=0 "small"-like model (MACE-MP-0 small: 128x0e, one residual-free first block)
    "small": dict(hidden="16x0e", max_ell=3, num_interactions=2, correlation=3,
                  first="RealAgnosticResidualInteractionBlock", pair=False, transform="None"),
    # L=1, two interactions, correlation 3 ("medium"-like)
    "medium": dict(hidden="8x0e+8x1o", max_ell=3, num_interactions=2, correlation=3,
                   first="RealAgnosticResidualInteractionBlock", pair=False, transform="None"),
    # pair repulsion and Agnesi transform, as MACE-MP-0b3; plain first block
    "b3": dict(hidden="8x0e+8x1o", max_ell=2, num_interactions=2, correlation=3,
               first="RealAgnosticInteractionBlock", pair=True, transform="Agnesi"),
}
ELEMENTS = [1, 6, 7, 8]


def build_torch_model(name: str, dtype: str = "float64", seed: int = 0, r_max: float = 4.0,
                      symmetric_scale: float = 3.0, config: dict | None = None, heads=None,
                      atomic_energies=None, scale=1.3, shift=-0.05, mlp_irreps: str = "16x0e",
                      radial_mlp=(16, 16, 16)):
    """A random ``ScaleShiftMACE``; ``heads`` (names) makes a multi-head model,
    then ``atomic_energies`` is (heads, elements) and ``scale``/``shift`` lists."""
    import mace  # noqa: F401  (before e3nn)
    import torch
    from e3nn import o3
    from mace import modules
    c = CONFIGS[name] if config is None else config
    torch.set_default_dtype(getattr(torch, dtype))
    torch.manual_seed(seed)
    model = modules.ScaleShiftMACE(
        r_max=r_max, num_bessel=8, num_polynomial_cutoff=5, max_ell=c["max_ell"],
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes[c["first"]],
        num_interactions=c["num_interactions"], num_elements=len(ELEMENTS),
        hidden_irreps=o3.Irreps(c["hidden"]), MLP_irreps=o3.Irreps(mlp_irreps),
        atomic_energies=(np.array([-13.6, -1030.0, -1485.0, -2040.0]) / 100.0
                         if atomic_energies is None else np.asarray(atomic_energies, np.float64)),
        avg_num_neighbors=6.0, atomic_numbers=ELEMENTS, correlation=c["correlation"],
        gate=torch.nn.functional.silu, pair_repulsion=c["pair"], distance_transform=c["transform"],
        radial_MLP=list(radial_mlp), atomic_inter_scale=scale, atomic_inter_shift=shift,
        **({} if heads is None else {"heads": list(heads)}))
    # random weights are O(1); by default scale the symmetric-contraction
    # ones up so that higher correlation orders matter in comparisons
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "symmetric_contractions" in name_:
                p.mul_(symmetric_scale)
    return model


def save_torch_model(model, path: str) -> str:
    import torch
    torch.save(model, path)
    return path


def random_molecule(rng, n_atoms=12, elements=ELEMENTS, spacing=1.1, jitter=0.2):
    """Atoms on a grid, each moved by up to ``jitter`` per coordinate (no two
    closer than spacing - 2 sqrt(3) jitter)."""
    side = int(np.ceil(n_atoms ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    pos = grid[rng.permutation(len(grid))[:n_atoms]] * spacing + rng.uniform(-jitter, jitter, (n_atoms, 3))
    Z = rng.choice(elements, n_atoms)
    return pos, Z


def random_cell(rng, n_atoms=24, elements=ELEMENTS, length=8.5):
    """A periodic, slightly triclinic cell (Angstrom)."""
    cell = np.diag([length, length * 1.05, length * 0.97]) + rng.uniform(-0.3, 0.3, (3, 3)) * (1 - np.eye(3))
    frac = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n_atoms] / 3.0
    frac = frac + rng.uniform(-0.04, 0.04, frac.shape)
    pos = frac @ cell
    Z = rng.choice(elements, n_atoms)
    return pos, Z, cell


_CALCULATORS = {}


def torch_energy_forces(model_path: str, pos, Z, cell=None, dtype="float64"):
    """Energy (eV) and forces (eV/Angstrom) from mace-torch's ASE calculator."""
    import ase
    from mace.calculators import MACECalculator
    if (model_path, dtype) not in _CALCULATORS:
        _CALCULATORS[model_path, dtype] = MACECalculator(model_paths=model_path, device="cpu",
                                                         default_dtype=dtype)
    atoms = ase.Atoms(numbers=Z, positions=pos, cell=cell, pbc=cell is not None)
    atoms.calc = _CALCULATORS[model_path, dtype]
    return atoms.get_potential_energy(), atoms.get_forces()


STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples",
                       "mace_jax", "nanotube_standin.npz")


def small_standin(folder, n: int = 10) -> str:
    """The first ``n`` structures of the nanotube stand-in as an MD22 .npz in ``folder``."""
    full = np.load(STANDIN)
    path = os.path.join(str(folder), "small.npz")
    np.savez(path, **{k: (full[k][:n] if k in ("R", "E", "F") else full[k]) for k in full.files})
    return path

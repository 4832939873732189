"""Write tests/_support/files/sevennet_reference.json: what sevenn itself
(not chemtrain) computes for three small structures with the SevenNet
checkpoints of its package, in float64. tests/models/test_nequip.py compares
chemtrain's NequIP with these numbers.

sevenn needs e3nn >= 0.5, and chemtrain's environment has mace-torch's e3nn
0.4.4, so run it with the side folder that scripts/setup.sh unpacks (e3nn
0.6 and sevenn's other imports; torch, ase and the rest from chemtrain's
environment):

    PYTHONPATH=.venv/sevenn-side .venv/bin/python tests/_support/files/make_sevennet_reference.py

The graph is ASE's neighbour list (every periodic image within the cutoff,
no self pair), as sevenn's own data loader builds it. sevenn casts its
one-hot embedding to float32 whatever the model's dtype; that cast is
lifted here so the whole model runs in float64.
"""
import json
import os
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "sevennet_reference.json")
MODELS = ("7net-0", "7net-0_22may2024", "7net-l3i5")


def structures():
    """Ten structures: bulk cells (some far narrower than twice the cutoff),
    a slab, molecules and the main job's 370-atom nanotube."""
    from ase import Atoms
    from ase.build import bulk, fcc111, molecule
    nacl = bulk("NaCl", "rocksalt", a=5.64)
    nacl.rattle(0.05, seed=1)
    si = bulk("Si", "diamond", a=5.43)
    si.rattle(0.03, seed=2)
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=5.0)
    ethanol.pbc = False
    cu = bulk("Cu", "fcc", a=3.6, cubic=True)
    cu.rattle(0.05, seed=3)
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0, a=3.6)
    slab.info.pop("adsorbate_info", None)
    slab.rattle(0.03, seed=4)
    mgo = bulk("MgO", "rocksalt", a=4.21, cubic=True)
    mgo.set_cell(mgo.cell * 1.01, scale_atoms=True)
    mgo.rattle(0.04, seed=5)
    al = bulk("Al", "fcc", a=4.05, cubic=True) * (2, 2, 2)
    al.set_cell(al.cell.array @ np.array([[1.0, 0.02, 0], [0, 0.99, 0], [0.01, 0, 1.0]]),
                scale_atoms=True)
    al.rattle(0.05, seed=6)
    gaas = bulk("GaAs", "zincblende", a=5.65)
    gaas.rattle(0.04, seed=7)
    water = molecule("H2O")
    water.pbc = False
    tube = np.load(os.path.join(HERE, "..", "..", "..", "examples", "mace_jax",
                                "nanotube_standin.npz"))
    nanotube = Atoms(numbers=tube["z"], positions=tube["R"][0], pbc=False)
    return {"NaCl": nacl, "Si": si, "ethanol": ethanol, "Cu": cu, "Cu_slab": slab, "MgO": mgo,
            "Al_sheared": al, "GaAs": gaas, "water": water, "nanotube": nanotube}


def graph(atoms, cutoff, key):
    import torch
    from ase.neighborlist import primitive_neighbor_list
    i, j, d, s = primitive_neighbor_list("ijDS", atoms.pbc, np.array(atoms.cell), atoms.positions,
                                         cutoff, self_interaction=True)
    keep = ~((i == j) & np.all(s == 0, axis=1))
    z = torch.tensor(atoms.numbers, dtype=torch.long)
    return {"x": z.clone(), key.ATOMIC_NUMBERS: z.clone(),
            key.POS: torch.tensor(atoms.positions, dtype=torch.float64),
            key.EDGE_IDX: torch.tensor(np.stack([i[keep], j[keep]]), dtype=torch.long),
            key.EDGE_VEC: torch.tensor(d[keep], dtype=torch.float64),
            key.CELL_VOLUME: torch.tensor(atoms.cell.volume if atoms.pbc.any() else 0.0,
                                          dtype=torch.float64),
            key.NUM_ATOMS: torch.tensor(len(atoms), dtype=torch.long)}


def main():
    warnings.filterwarnings("ignore")
    import sevenn._keys as key
    import sevenn.nn.node_embedding as embedding
    from sevenn.checkpoint import SevenNetCheckpoint
    from sevenn.util import pretrained_name_to_path
    original = embedding.OnehotEmbedding.forward

    def float64_onehot(self, data):
        data = original(self, data)
        data[self.key_output] = data[self.key_output].to(data[key.POS].dtype)
        return data
    embedding.OnehotEmbedding.forward = float64_onehot
    import sevenn
    out = {"generated_by": f"sevenn {sevenn.__version__}, tests/_support/files/make_sevennet_reference.py",
           "structures": {name: {"numbers": a.numbers.tolist(), "positions": a.positions.tolist(),
                                 "cell": np.array(a.cell).tolist(), "pbc": a.pbc.tolist()}
                          for name, a in structures().items()},
           "models": {}}
    for name in MODELS:
        checkpoint = SevenNetCheckpoint(pretrained_name_to_path(name))
        model = checkpoint.build_model().double()
        model.set_is_batch_data(False)
        model.eval()
        results = {}
        for structure, atoms in structures().items():
            r = model(graph(atoms, checkpoint.config["cutoff"], key))
            # sevenn's ASE calculator: stress = -PRED_STRESS in Voigt order (eV/A^3)
            stress = -r[key.PRED_STRESS].detach().numpy().ravel()[[0, 1, 2, 4, 5, 3]]
            results[structure] = {"energy": float(r[key.PRED_TOTAL_ENERGY].detach()),
                                  "forces": r[key.PRED_FORCE].detach().numpy().tolist(),
                                  "stress": stress.tolist() if atoms.pbc.any() else None}
        out["models"][name] = results
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", OUT)


if __name__ == "__main__":
    main()

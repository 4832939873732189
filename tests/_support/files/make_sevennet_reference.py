"""Write tests/_support/files/sevennet_reference.json: what sevenn itself
(not chemtrain) computes for three small structures with the SevenNet
checkpoints of its package, in float64. tests/models/test_nequip.py compares
chemtrain's NequIP with these numbers.

sevenn needs e3nn >= 0.5, and chemtrain's environment has mace-torch's e3nn
0.4.4, so run it with both wheels unpacked on PYTHONPATH (torch, ase and the
rest from chemtrain's environment):

    pip download --no-deps -d /tmp/w sevenn==0.13.0 e3nn==0.6.0
    (cd /tmp/w && for f in *.whl; do python -m zipfile -e "$f" src; done)
    PYTHONPATH=/tmp/w/src .venv/bin/python tests/_support/files/make_sevennet_reference.py

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
    from ase.build import bulk, molecule
    nacl = bulk("NaCl", "rocksalt", a=5.64)
    nacl.rattle(0.05, seed=1)
    si = bulk("Si", "diamond", a=5.43)
    si.rattle(0.03, seed=2)
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=5.0)
    ethanol.pbc = False
    return {"NaCl": nacl, "Si": si, "ethanol": ethanol}


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

"""Does fine-tuning forget? A foundation MACE, three fine-tunings, errors on both data sets.

    .venv/bin/python examples/mace_jax/forgetting.py                    # a few minutes on 2 cores
    .venv/bin/python examples/mace_jax/forgetting.py --epochs 2 --foundation-epochs 2   # quick look

1. A "foundation" MACE is trained with ``chemtrain-finetune`` on set A
   (``forgetting_data.py``: bulk, slabs and clusters of six fcc metals and
   two alloys, ASE's EMT).
2. It is fine-tuned on set B (Cu only, EMT with changed Cu parameters,
   standing in for a higher level of theory) in three ways:
   - naive: all weights trained on B;
   - naive + EMA + frozen: a moving average of the weights is evaluated and
     exported (``--ema``), the embedding and the first interaction and
     product are kept fixed (``--freeze embedding,interactions.0,products.0``);
   - replay: a second readout head for B while the structures of A keep
     training the shared layers through the foundation's head
     (``--pt_train_file A_train.xyz``, mace-torch's multi-head fine-tuning,
     with its 'universal' loss; ``--force_mh_ft_lr True`` keeps the
     learning rate of the other rows).
3. Each model (for replay: the fine-tuned head, ``Default``) is tested on
   the held-out part of A (no Cu, where both levels of theory agree, so
   forgetting shows as a larger error) and on B's test set: energy RMSE in
   meV/atom, force-component RMSE in meV/Å.

Every fine-tuning uses the same learning rate, batch size, loss weights,
a constant learning rate (mace-torch's default plateau schedule is
constant in runs this short) and the same number of optimizer steps: a
replay epoch holds B's and A's structures, so the naive fine-tunings run
as many more epochs as make up the steps of ``--epochs`` replay epochs.
``chemtrain_rows`` is what ``benchmarks/finetune_vs_mace_torch.py`` runs
for chemtrain's side.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forgetting_data  # noqa: E402

# the architecture and loss of every run (mace-torch names)
MODEL = ["--num_channels", "8", "--max_L", "0", "--max_ell", "1", "--correlation", "2",
         "--r_max", "5.0", "--num_interactions", "2"]
LOSS = ["--energy_weight", "1.0", "--forces_weight", "10.0"]
VARIANTS = {
    "naive": [],
    "naive + EMA + frozen": ["--ema", "--ema_decay", "0.99", "--freeze",
                             "embedding,interactions.0,products.0"],
    # every structure of A_train replayed (no validation share: --valid_file is B's)
    "replay": ["--pt_train_file", "{A_train}", "--force_mh_ft_lr", "True",
               "--valid_fraction", "0"],
}


def files(folder: str) -> dict:
    """The data files' paths (written by ``forgetting_data.write``)."""
    return {name: os.path.join(folder, f"{name}.xyz") for name in
            ("A_train", "A_valid", "A_test", "B_train", "B_valid", "B_test")}


def train_foundation(folder: str, out: str, *, epochs: int, seed: int = 0,
                     lr: float = 0.01, batch: int = 4) -> str:
    """Train the foundation model on A; return its ``model.npz`` (the
    mace-torch ``model.model`` lies next to it)."""
    from chemtrain.finetune import run
    f = files(folder)
    run(["--train_file", f["A_train"], "--valid_file", f["A_valid"], "--test_file",
         f["A_test"], "--E0s", "average", "--max_num_epochs", str(epochs), "--lr", str(lr),
         "--batch_size", str(batch), "--seed", str(seed), "--results_dir", out, *MODEL, *LOSS])
    return os.path.join(out, "model.npz")


def errors(model_npz: str, path: str, head=None) -> dict:
    """Energy-per-atom RMSE (meV/atom) and force-component RMSE (meV/Å) of a
    chemtrain MACE file (and head) on the structures of an extxyz file."""
    import ase.io
    from chemtrain.calculator import ChemtrainCalculator
    calc = ChemtrainCalculator.from_mace(model_npz, head=head)
    de, df = [], []
    for atoms in ase.io.read(path, ":"):
        ref_e, ref_f = atoms.info["REF_energy"], atoms.arrays["REF_forces"]
        atoms.calc = calc
        de.append((atoms.get_potential_energy() - ref_e) / len(atoms))
        df.append(atoms.get_forces() - ref_f)
    return {"energy_meV_per_atom": 1e3 * float(np.sqrt(np.mean(np.square(de)))),
            "force_meV_per_A": 1e3 * float(np.sqrt(np.mean(np.concatenate(df) ** 2)))}


def chemtrain_rows(folder: str, foundation_npz: str, out: str, *, epochs: int, lr: float,
                   batch: int, seed: int) -> dict:
    """The foundation's errors and those of the three fine-tunings on B.

    Returns:
      ``{"foundation" | "naive" | "naive + EMA + frozen" | "replay": row}``,
      ``row = {"A": errors, "B": errors, "steps": optimizer steps,
      "wall_s": seconds}`` with ``errors`` as :func:`errors` gives them.
    """
    import ase.io
    from chemtrain.finetune import run
    f = files(folder)
    n_b = len(ase.io.read(f["B_train"], ":"))
    n_a = len(ase.io.read(f["A_train"], ":"))
    n_replayed = n_a   # --valid_fraction 0: every structure of A_train
    replay_steps = epochs * ((n_b + n_replayed) // batch)
    naive_epochs = -(-replay_steps // (n_b // batch))
    rows = {"foundation": {"A": errors(foundation_npz, f["A_test"]),
                           "B": errors(foundation_npz, f["B_test"]), "steps": 0, "wall_s": 0.0}}
    for name, extra in VARIANTS.items():
        where = os.path.join(out, name.replace(" ", "").replace("+", "_"))
        start = time.perf_counter()
        result = run(["--train_file", f["B_train"], "--valid_file", f["B_valid"], "--test_file",
                      f["B_test"], "--foundation_model", foundation_npz, "--E0s", "foundation",
                      "--max_num_epochs", str(epochs if name == "replay" else naive_epochs),
                      "--lr", str(lr), "--batch_size",
                      str(batch), "--seed", str(seed), "--scheduler", "constant",
                      "--results_dir", where, *LOSS, *[x.format(**f) for x in extra]])
        wall = time.perf_counter() - start
        with open(os.path.join(where, "metrics.jsonl")) as fh:
            steps = [json.loads(line)["step"] for line in fh][-1]
        head = "Default" if name == "replay" else None
        rows[name] = {"A": errors(result["model_npz"], f["A_test"], head),
                      "B": errors(result["model_npz"], f["B_test"], head),
                      "steps": steps, "wall_s": wall}
        if name == "replay":   # the foundation's head after replay, for reference
            rows[name]["A_pt_head"] = errors(result["model_npz"], f["A_test"], "pt_head")
    return rows


def table(rows: dict, title: str) -> str:
    lines = [title, f"{'':24s} {'A energy':>9s} {'A force':>9s} {'B energy':>9s} {'B force':>9s}"
             f" {'steps':>6s} {'wall s':>7s}",
             f"{'':24s} {'meV/atom':>9s} {'meV/Å':>9s} {'meV/atom':>9s} {'meV/Å':>9s}"]
    for name, r in rows.items():
        lines.append(f"{name:24s} {r['A']['energy_meV_per_atom']:9.1f} "
                     f"{r['A']['force_meV_per_A']:9.1f} {r['B']['energy_meV_per_atom']:9.1f} "
                     f"{r['B']['force_meV_per_A']:9.1f} {r['steps']:6d} {r['wall_s']:7.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/forgetting")
    p.add_argument("--foundation-epochs", type=int, default=30)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("chemtrain").setLevel(logging.INFO)
    data = os.path.join(a.work, "data")
    print(json.dumps(forgetting_data.write(data, a.seed)))
    foundation = train_foundation(data, os.path.join(a.work, "foundation"),
                                  epochs=a.foundation_epochs, seed=a.seed)
    rows = chemtrain_rows(data, foundation, os.path.join(a.work, "finetuned"), epochs=a.epochs,
                          lr=a.lr, batch=a.batch, seed=a.seed)
    print(table(rows, "chemtrain: test RMSE on A (held out, no Cu) and B"))
    r = rows["replay"]
    print(f"replay, foundation's head on A: energy {r['A_pt_head']['energy_meV_per_atom']:.1f} "
          f"meV/atom, force {r['A_pt_head']['force_meV_per_A']:.1f} meV/Å")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

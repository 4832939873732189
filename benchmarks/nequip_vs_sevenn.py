"""Speed: chemtrain's NequIP against sevenn's own torch model, SevenNet-0,
the same structures, side by side (CPU, float32).

    .venv/bin/python benchmarks/nequip_vs_sevenn.py                 # about 3 min
    .venv/bin/python benchmarks/nequip_vs_sevenn.py --repeats 3

Two measurements per structure (the main job's 370-atom nanotube in free
space; a rattled 64-atom Si cell), each the median of ``--repeats`` calls
after one warm-up call (compilation, torch's first pass):

- **energy and forces**: one call on a graph built beforehand (every
  periodic image within 5 A, ASE's neighbour list, the same edges for both):
  chemtrain's jitted ``value_and_grad`` of the energy template; sevenn's
  ``E3GNN`` forward (its force output by autograd), ``model.eval()``;
- **a training step**: loss = (energy error)^2 + mean (force error)^2
  against fixed targets, its gradient with respect to every weight and one
  Adam step: chemtrain's jitted step (optax); sevenn's model in
  ``train()`` mode, ``loss.backward()``, ``torch.optim.Adam``.

sevenn runs in a subprocess with the side folder of ``scripts/setup.sh``
(``.venv/sevenn-side``: e3nn 0.6 and sevenn's imports) on its path; torch
uses every core (``torch.get_num_threads()`` is printed), XLA likewise.
The script prints both tables, the ratios chemtrain / sevenn (the issue's
goal: at most 0.5), and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CUTOFF = 5.0   # A, SevenNet-0's


def structures():
    from ase import Atoms
    from ase.build import bulk
    tube = np.load(os.path.join(ROOT, "examples", "mace_jax", "nanotube_standin.npz"))
    si = bulk("Si", "diamond", a=5.43, cubic=True) * (2, 2, 2)
    si.rattle(0.05, seed=0)
    return {"nanotube (370 atoms)": Atoms(numbers=tube["z"], positions=tube["R"][0]),
            "Si cell (64 atoms)": si}


def edges(atoms):
    """Senders i, receivers j and the vectors R_j - R_i + shift (A), every image."""
    from ase.neighborlist import primitive_neighbor_list
    i, j, d, S = primitive_neighbor_list("ijDS", atoms.pbc, np.array(atoms.cell), atoms.positions,
                                         CUTOFF, self_interaction=True)
    keep = ~((i == j) & np.all(S == 0, axis=1))
    return i[keep], j[keep], d[keep], S[keep]


def median_time(fn, repeats):
    fn()   # warm-up: compilation, first pass
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def chemtrain_side(repeats):
    import jax
    import jax.numpy as jnp
    import optax
    from chemtrain.models import nequip
    from chemtrain.models.nequip.model import node_energies
    cfg, params = nequip.load_sevennet("sevennet-0", trusted=True, dtype=np.float32)
    params = jax.tree.map(jnp.asarray, params)
    table = cfg.element_table()

    def energy(params, R, send, recv, shifts_A, element):
        vec = R[recv] - R[send] + shifts_A
        return jnp.sum(node_energies(params, cfg, vec, send, recv, jnp.ones(len(send), bool),
                                     element))
    forces = jax.jit(jax.value_and_grad(energy, argnums=1))
    opt = optax.adam(1e-4)

    @jax.jit
    def step(params, opt_state, R, send, recv, shifts_A, element, e_ref, f_ref):
        def loss(p):
            e, g = jax.value_and_grad(energy, argnums=1)(p, R, send, recv, shifts_A, element)
            return (e - e_ref) ** 2 + jnp.mean((-g - f_ref) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    out = {}
    for name, atoms in structures().items():
        i, j, _, S = edges(atoms)
        shifts = (S @ np.array(atoms.cell)).astype(np.float32)
        args = (jnp.asarray(atoms.positions, jnp.float32), jnp.asarray(i), jnp.asarray(j),
                jnp.asarray(shifts), jnp.asarray(table[atoms.numbers]))
        t_ef = median_time(lambda: jax.block_until_ready(forces(params, *args)), repeats)
        state = {"p": params, "o": opt.init(params)}
        target = (jnp.float32(-3.0 * len(atoms)), jnp.zeros((len(atoms), 3), jnp.float32))

        def one_step():
            p, o, v = step(state["p"], state["o"], *args, *target)
            jax.block_until_ready(v)
            state.update(p=p, o=o)
        out[name] = {"energy_forces_s": t_ef, "train_step_s": median_time(one_step, repeats),
                     "edges": int(len(i))}
    return out


SEVENN = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from nequip_vs_sevenn import edges, median_time, structures
import sevenn._keys as key
from sevenn.checkpoint import SevenNetCheckpoint
from sevenn.util import pretrained_name_to_path
repeats = int(sys.argv[2])
checkpoint = SevenNetCheckpoint(pretrained_name_to_path("7net-0"))
out = {"torch_threads": torch.get_num_threads()}
for name, atoms in structures().items():
    i, j, d, _ = edges(atoms)
    def graph():
        z = torch.tensor(atoms.numbers, dtype=torch.long)
        return {"x": z.clone(), key.ATOMIC_NUMBERS: z.clone(),
                key.POS: torch.tensor(atoms.positions, dtype=torch.float32),
                key.EDGE_IDX: torch.tensor(np.stack([i, j]), dtype=torch.long),
                key.EDGE_VEC: torch.tensor(d, dtype=torch.float32),
                key.CELL_VOLUME: torch.tensor(atoms.cell.volume if atoms.pbc.any() else 0.0),
                key.NUM_ATOMS: torch.tensor(len(atoms), dtype=torch.long)}
    model = checkpoint.build_model()
    model.set_is_batch_data(False)
    model.eval()
    t_ef = median_time(lambda: model(graph())[key.PRED_FORCE].detach(), repeats)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    e_ref, f_ref = torch.tensor(-3.0 * len(atoms)), torch.zeros((len(atoms), 3))
    def step():
        opt.zero_grad()
        r = model(graph())
        loss = (r[key.PRED_TOTAL_ENERGY] - e_ref) ** 2 + torch.mean((r[key.PRED_FORCE] - f_ref) ** 2)
        loss.backward()
        opt.step()
    out[name] = {"energy_forces_s": t_ef, "train_step_s": median_time(step, repeats),
                 "edges": int(len(i))}
print("RESULT " + json.dumps(out))
"""


def sevenn_side(repeats):
    side = os.path.join(sys.prefix, "sevenn-side")
    if not os.path.isdir(os.path.join(side, "e3nn")):
        raise SystemExit(f"{side} is missing: run scripts/setup.sh (it unpacks sevenn's imports).")
    out = subprocess.run([sys.executable, "-c", SEVENN, HERE, str(repeats)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": side}, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"sevenn's side failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    ours = chemtrain_side(args.repeats)
    theirs = sevenn_side(args.repeats)
    print(f"sevenn: torch threads {theirs.pop('torch_threads')}; both float32, CPU")
    ratios = {}
    for name in ours:
        for what in ("energy_forces_s", "train_step_s"):
            a, b = ours[name][what], theirs[name][what]
            ratios[f"{name}: {what}"] = a / b
            print(f"{name:22s} {what:16s} chemtrain {a:8.3f} s   sevenn {b:8.3f} s   "
                  f"ratio {a / b:.2f}  ({ours[name]['edges']} edges)")
    print(json.dumps({"chemtrain": ours, "sevenn": theirs, "ratio": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

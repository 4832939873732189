"""chemtrain's JAX MACE against mace-torch on the same machine, same model
(converted from the mace-torch one) and the same 370-atom structure.

Times (median of repeats, after warm-up/compilation):
  * energy + forces,
  * one training step: energy and force loss, gradient with respect to all
    parameters (torch: forward with create_graph, backward; JAX: jit(grad)).
Prints JAX/torch ratios (target: at most 1.0).

    .venv/bin/python benchmarks/mace_vs_torch.py [--model small|medium] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

MODELS = {
    # MACE-MP-0 "small" and "medium" hyper-parameters (89 elements as MP-0)
    "small": dict(hidden="128x0e", max_ell=3, correlation=3),
    "medium": dict(hidden="128x0e+128x1o", max_ell=3, correlation=3),
}


def nanotube():
    """A hydrogen-terminated double-walled carbon nanotube of 370 atoms (320 C,
    50 H; a (7,0) tube inside a (9,9) tube, 3.4 Angstrom apart), the size of
    MD22's; Angstrom, open boundaries."""
    import ase
    from ase.build import nanotube as tube
    from ase.neighborlist import neighbor_list
    atoms = tube(7, 0, length=5, bond=1.42) + tube(9, 9, length=5, bond=1.42)
    atoms.set_pbc(False)
    coord = np.bincount(neighbor_list("i", atoms, 1.6), minlength=len(atoms))
    pos = atoms.positions
    zc = pos[:, 2].mean()
    ends = np.where(coord < 3)[0]   # one H on each under-coordinated carbon, along the axis
    h = pos[ends] + np.array([0.0, 0.0, 1.09]) * np.sign(pos[ends, 2:3] - zc)
    full = ase.Atoms(numbers=[6] * len(atoms) + [1] * len(h), positions=np.vstack([pos, h]))
    full.center(vacuum=5.0)
    assert len(full) == 370, len(full)
    return full


def median_time(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (torch); JAX uses its default backend")
    ap.add_argument("--method", default=None, help="cuequivariance-jax method (default: automatic)")
    args = ap.parse_args()

    import jax
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import mace  # noqa: F401
    import torch
    from e3nn import o3
    from mace import modules
    from mace import data as mace_data
    from mace.tools import torch_geometric
    from mace.tools.utils import AtomicNumberTable
    from chemtrain.models import mace as cm
    from chemtrain.models.mace import model as M

    torch.set_default_dtype(getattr(torch, args.dtype))
    torch.manual_seed(0)
    c = MODELS[args.model]
    elements = list(range(1, 90))
    tm = modules.ScaleShiftMACE(
        r_max=6.0, num_bessel=10, num_polynomial_cutoff=5, max_ell=c["max_ell"],
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        num_interactions=2, num_elements=len(elements), hidden_irreps=o3.Irreps(c["hidden"]),
        MLP_irreps=o3.Irreps("16x0e"), atomic_energies=np.zeros(len(elements)),
        avg_num_neighbors=20.0, atomic_numbers=elements, correlation=c["correlation"],
        gate=torch.nn.functional.silu, radial_MLP=[64, 64, 64],
        atomic_inter_scale=1.0, atomic_inter_shift=0.0).to(args.device)
    path = f"/tmp/chemtrain-bench-mace-{args.model}-{args.dtype}.model"
    torch.save(tm.cpu(), path)
    tm = tm.to(args.device)
    t0 = time.perf_counter()
    cfg, params = cm.load_mace_torch(path, trusted=True)
    t_convert = time.perf_counter() - t0

    atoms = nanotube()
    n = len(atoms)
    z_table = AtomicNumberTable(elements)
    cfg_data = mace_data.config_from_atoms(atoms)
    graph = mace_data.AtomicData.from_config(cfg_data, z_table=z_table, cutoff=cfg.r_max)
    batch = torch_geometric.batch.Batch.from_data_list([graph]).to(args.device)
    n_edges = batch["edge_index"].shape[1]
    rng = np.random.default_rng(0)
    F_ref_np = rng.normal(size=(n, 3))
    F_ref = torch.tensor(F_ref_np, dtype=getattr(torch, args.dtype), device=args.device)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def torch_ef():
        out = tm(batch.to_dict(), training=False, compute_force=True)
        sync()
        return out

    def torch_step():
        tm.zero_grad()
        out = tm(batch.to_dict(), training=True, compute_force=True)
        loss = (out["energy"][0] - 1.0) ** 2 + torch.mean((out["forces"] - F_ref) ** 2)
        loss.backward()
        sync()
        return loss

    # JAX: the same edges (mace's own neighbor list), through node_energies
    dt = getattr(jnp, args.dtype)
    ei = batch["edge_index"].cpu().numpy()
    senders, receivers = jnp.asarray(ei[0]), jnp.asarray(ei[1])
    shifts = jnp.asarray(batch["shifts"].cpu().numpy(), dt)
    R = jnp.asarray(atoms.positions, dt)
    element = jnp.asarray(np.searchsorted(elements, atoms.numbers))
    p = jax.tree.map(lambda x: jnp.asarray(x, dt), params)
    edge_mask = jnp.ones(n_edges, bool)
    node_mask = jnp.ones(n, bool)

    def energy(p, R):
        vec = R[receivers] - R[senders] + shifts
        # vmap_safe=False: as the trainers' batched energies (no vmap here)
        return jnp.sum(M.node_energies(p, cfg, vec, senders, receivers, edge_mask, element, node_mask,
                                       method=args.method, vmap_safe=False))

    ef = jax.jit(jax.value_and_grad(energy, argnums=1))
    F_ref_j = jnp.asarray(F_ref_np, dt)

    def loss(p, R):
        E, G = jax.value_and_grad(energy, argnums=1)(p, R)
        return (E - 1.0) ** 2 + jnp.mean((-G - F_ref_j) ** 2)
    step = jax.jit(jax.grad(loss))

    # agreement first (so the timings compare the same computation)
    out = torch_ef()
    E_j, G_j = ef(p, R)
    e_t = float(out["energy"][0].detach())
    rel_E = abs(float(E_j) - e_t) / abs(e_t)
    rel_F = float(np.abs(-np.asarray(G_j) - out["forces"].detach().cpu().numpy()).max()
                  / np.abs(out["forces"].detach().cpu().numpy()).max())

    t0 = time.perf_counter()
    jax.block_until_ready(step(p, R))
    t_compile_step = time.perf_counter() - t0
    t_ef_torch = median_time(torch_ef, args.repeats)
    t_ef_jax = median_time(lambda: jax.block_until_ready(ef(p, R)), args.repeats)
    t_step_torch = median_time(torch_step, args.repeats)
    t_step_jax = median_time(lambda: jax.block_until_ready(step(p, R)), args.repeats)

    print(f"model {args.model} ({c['hidden']}, max_ell {c['max_ell']}, correlation {c['correlation']}, "
          f"{len(elements)} elements), {args.dtype}, {n} atoms, {n_edges} edges, "
          f"torch {torch.__version__} on {args.device} ({torch.get_num_threads()} threads), "
          f"jax {jax.__version__} on {jax.default_backend()}, method {args.method or M.default_method()}")
    print(f"agreement: energy rel {rel_E:.1e}, forces rel {rel_F:.1e}; conversion {t_convert:.1f} s, "
          f"JAX step compile {t_compile_step:.1f} s")
    print(f"energy+forces  torch {1e3 * t_ef_torch:9.1f} ms   jax {1e3 * t_ef_jax:9.1f} ms   "
          f"ratio jax/torch {t_ef_jax / t_ef_torch:.3f}")
    print(f"training step  torch {1e3 * t_step_torch:9.1f} ms   jax {1e3 * t_step_jax:9.1f} ms   "
          f"ratio jax/torch {t_step_jax / t_step_torch:.3f}")


if __name__ == "__main__":
    sys.exit(main())

"""Where the main job's training step spends its time (issue 36's diagnosis).

    .venv/bin/python benchmarks/profile_main_job.py [--steps 20] [--batch 2]

Builds the main job's data and model exactly as ``chemtrain-finetune`` does
for ``examples/mace_jax/finetune_md22.py`` (nanotube stand-in, 370 atoms,
precomputed graphs, a random MACE of 8 channels, L_max 1, correlation 2,
r_max 4 Å, float32) and times, after compilation, per step of ``--batch``
structures (median of ``--steps``, each blocked until done):

1. energy only (forward);
2. energy and forces (forward and one backward pass for positions);
3. the loss and its parameter gradient (forces inside: a second backward);
4. the compiled update (3 plus Adam and the finite checks);
5. the trainer's whole step as ``ForceMatching.train`` runs it (4 plus the
   host's work per step), from an epoch's wall time divided by its steps.

It also prints the edges computed against the edges present (padding). With
``--blocks`` it times the parameter gradient of the loss for each block of
parameters alone (XLA prunes what that block does not need), and for each
layer of the first radial MLP: what a block's gradient costs beyond the
forces is that block's share of the second backward pass. Nothing is
changed; the figures say where to look.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def median_time(fn, steps):
    fn()  # compile
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def radial_mlp_alone(steps, edges=7690):
    """The radial MLP (10 Bessel features -> 64 -> 64 -> 64 -> 16, SiLU) of
    every edge of two structures, and the parameter gradient of a force-like
    loss (the squared derivative with respect to the edge length): the
    second backward pass the trainer's step runs. Three layouts of the same
    numbers: vmap over the two structures, one flat array, lax.map."""
    import jax
    import jax.numpy as jnp
    from chemtrain.models.mace.blocks import mlp
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s), jnp.float32)
          for s in [(10, 64), (64, 64), (64, 64), (64, 16)]]
    r = jnp.asarray(rng.uniform(0.5, 4.0, (2, edges)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, edges, 16)), jnp.float32)
    k = jnp.arange(1, 11, dtype=jnp.float32)

    def one(ws, r, g):
        out = lambda rr: mlp(ws, jnp.sin(k * rr[..., None]) / rr[..., None], 1.68)  # noqa: E731
        d = jax.grad(lambda rr: jnp.sum(out(rr) * g))(r)
        return jnp.sum(d ** 2)
    layouts = {
        "vmap over structures": lambda ws: jnp.sum(jax.vmap(one, (None, 0, 0))(ws, r, g)),
        "one flat edge array": lambda ws: one(ws, r.reshape(-1), g.reshape(-1, 16)),
        "lax.map over structures": lambda ws: jnp.sum(jax.lax.map(lambda x: one(ws, *x), (r, g))),
    }
    for name, f in layouts.items():
        grad = jax.jit(jax.grad(f))
        ms = 1e3 * median_time(lambda: jax.block_until_ready(grad(ws)), steps)
        print(f"radial MLP second backward, {name:24s} {ms:7.1f} ms")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--blocks", action="store_true",
                   help="also time the loss gradient of each parameter block alone")
    p.add_argument("--mlp", action="store_true",
                   help="only time a radial MLP's second backward pass alone, on the main "
                        "job's edges of two structures: under jax.vmap over the structures (as "
                        "the trainer evaluates a batch), on one flat edge array, with lax.map")
    a = p.parse_args(argv)
    if a.mlp:
        return radial_mlp_alone(a.steps)
    import jax
    import jax.numpy as jnp
    import optax
    from chemtrain.data.loader import VALID
    from chemtrain.finetune import data as D, model as M
    from chemtrain.learn import force_matching as fm
    from chemtrain.learn.step import make_update
    from chemtrain.models import mace
    from chemtrain.parallel import make_strategy
    sys.path.insert(0, "examples/mace_jax")
    from finetune_md22 import STANDIN

    raw = D.read(STANDIN)
    train = D.take(raw, np.arange(60))
    ready = D.to_model_arrays(train, 4.0 * D.LENGTH, np.float32, True)
    real = (ready["senders"] < ready["R"].shape[1]).sum(1)
    print(f"structures {len(ready['R'])}, atoms {ready['R'].shape[1]}, edge capacity "
          f"{ready['senders'].shape[1]}, edges present mean {real.mean():.0f} min {real.min()} "
          f"max {real.max()} (padding {1 - real.mean() / ready['senders'].shape[1]:.1%})")
    sample = D.take(train, np.arange(32))
    rms = float(np.sqrt(np.mean(train["F"] ** 2))) / D.FORCE
    cfg = M.random_config(sorted(set(train["species"].ravel().tolist())),
                          D.mean_pairs(D.to_model_arrays(sample, 0.4, np.float32, False)), rms,
                          num_channels=8, max_L=0, max_ell=1, correlation=2, r_max=4.0)
    params = mace.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    cfg = M.set_e0s(cfg, "average", train, False)[0]
    template = mace.energy_fn_template(cfg)
    gammas = {"U": 1.0 / D.ENERGY ** 2, "F": 1.0 / D.FORCE ** 2}
    exclude = {"R", "U", "F", VALID, "U_weight"}
    predict = fm.make_predictor(template, None)
    b = a.batch
    batch = {k: jnp.asarray(v[:b]) for k, v in ready.items()}
    batch[VALID] = jnp.ones(b, bool)
    kw = fm.batch_kwargs(batch, exclude)

    def energy_only(p, R, kw):
        from chemtrain.neighbors import graph_from
        g = graph_from(kw)
        rest = {k: v for k, v in kw.items() if k not in ("senders", "receivers", "shifts")}
        return jax.vmap(lambda r, gg, kk: template(p)(r, neighbor=gg, **kk))(R, g, rest)

    e_fn = jax.jit(energy_only)
    f_fn = jax.jit(lambda p, R, kw: predict(p, R, kw)[0])
    loss = fm.make_shard_loss(predict, gammas, {"U": "U_weight"}, exclude)
    g_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    strategy = make_strategy("single")
    opt = optax.adam(0.02)
    update = make_update(loss, opt, strategy)
    state = {"p": strategy.replicate(params), "o": strategy.replicate(opt.init(params))}

    def do_update():
        state["p"], state["o"], s = update(state["p"], state["o"], batch)
        jax.block_until_ready(s["loss"])

    rows = [
        ("energy (forward)", lambda: jax.block_until_ready(e_fn(params, batch["R"], kw))),
        ("energy + forces", lambda: jax.block_until_ready(f_fn(params, batch["R"], kw))),
        ("loss + parameter gradient", lambda: jax.block_until_ready(g_fn(params, batch))),
        ("compiled update (+ Adam, checks)", do_update),
    ]
    times = {}
    for name, fn in rows:
        times[name] = median_time(fn, a.steps)
        print(f"{name:36s} {1e3 * times[name]:8.1f} ms per step of {b}")
    # the trainer's own epoch: steps and host work included
    from chemtrain.trainers import ForceMatching, RunOptions
    tr = ForceMatching(params, opt, template, None, batch=b, parallelism="single", gammas=gammas,
                       weights_keys={"U": "U_weight"}, checkpoint_path="/tmp/pmj",
                       options=RunOptions(progress=False))
    tr.set_dataset(ready, "training")
    tr.train(1)
    t = time.perf_counter()
    tr.train(2)
    steps = 2 * (len(ready["R"]) // b)
    per = (time.perf_counter() - t) / steps
    print(f"{'ForceMatching step (epoch / steps)':36s} {1e3 * per:8.1f} ms per step of {b}")
    print(f"host and loop overhead over the compiled update: "
          f"{1e3 * (per - times['compiled update (+ Adam, checks)']):.1f} ms per step")
    if a.blocks:
        leaves, tree = jax.tree_util.tree_flatten_with_path(params)
        names = [jax.tree_util.keystr(path) for path, _ in leaves]
        groups = {}
        for name in names:   # a block: a leaf's path up to its kind (radial_mlp, linear, ...)
            cut = name.find("]", name.find("]['") + 3) if "]['" in name else len(name) - 1
            groups.setdefault(name[:cut + 1], []).append(name)
        groups.update({n: [n] for n in names if "['interactions'][0]['radial_mlp']" in n})

        def block_time(chosen):
            def f(sub):
                full = jax.tree_util.tree_unflatten(tree, [sub.get(n, v) for n, (_, v)
                                                           in zip(names, leaves)])
                return loss(full, batch)[0]
            grad = jax.jit(jax.grad(f))
            sub = {n: v for n, (_, v) in zip(names, leaves) if n in chosen}
            return median_time(lambda: jax.block_until_ready(grad(sub)), a.steps)
        print("loss gradient of one block alone (the forces included):")
        for group, chosen in groups.items():
            print(f"  {group:48s} {1e3 * block_time(chosen):8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One update of the reweighting loop (:class:`~.reweighting.Reweighting`),
as functions of the trainer: this process's state points (reused or
recomputed trajectories, the objective's results), the sum of the
objective's contributions over processes, the checks and the step of
:mod:`chemtrain.learn.update`, the objective's numbers after the step and
the ``on_update`` callback."""
from __future__ import annotations

import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..learn import update as upd
from ..learn.diagnose import all_finite
from ..learn.difftre_batches import statepoint_key, train_key
from ..learn.reuse import independent_samples, needs_recompute, reuse_distance
from ..simulate.trajectory import NeighborListOverflowError, SimulationError

log = logging.getLogger("chemtrain")


def _norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(tree)))


def _inputs_key(trainer, index):
    update = trainer.update_count
    return lambda stream: statepoint_key(jax.random.fold_in(trainer.key, stream), index, update)


def local_results(trainer, local, params):
    """The objective's result for ``trainer``'s state points ``local`` (this
    process's), recomputing a trajectory where the reuse rule says so;
    returns (results, inputs, new trajectories)."""
    out, inputs, new = {}, {}, {}
    objective = trainer.objective
    for i in local:
        sp, trajs = trainer.statepoints[i], trainer.trajstates[i]
        inputs[i] = objective.inputs(sp, _inputs_key(trainer, i))
        derived = trainer.trajectories.derived_of(objective, sp, params)
        result = objective.result(sp, params, trajs, derived, inputs[i])
        n_eff_start = float(result["aux"]["n_eff"])
        n_indep = independent_samples([np.asarray(t.U_ref) for t in trajs])
        distance = reuse_distance(n_eff_start, sp.n_snapshots, n_indep)
        recompute = needs_recompute(n_eff_start, sp.n_snapshots, trainer.reweight_ratio,
                                    n_indep, trainer.max_reuse_se, trainer._reuses()[i],
                                    trainer.max_reuses)
        if recompute:
            keys = [train_key(trainer.key, i, trainer.update_count, c) for c in range(len(trajs))]
            trajs = new[i] = trainer.trajectories.run(sp, params, trajs, keys)
            result = objective.result(sp, params, trajs, objective.derive(sp, params, trajs),
                                      inputs[i])
        out[i] = dict(result, n_eff_start=n_eff_start, recomputed=recompute,
                      n_independent=n_indep, reuse_se=distance)
    return out, inputs, new

def apply_update(trainer, batch, epoch):
    """One update over the state points ``batch``: each process computes
    its own, the objective's contributions are summed over processes,
    and the pure functions of :mod:`chemtrain.learn.update` decide and
    scale the step."""
    params, local = trainer.params, trainer._local(batch)
    where = f"update {trainer.update_count} (epoch {epoch}, state points {batch})"
    try:
        out, inputs, new = trainer._agree(lambda: local_results(trainer, local, params),
                                          f"computing update {trainer.update_count}")
    except (NeighborListOverflowError, SimulationError) as e:
        trainer._fail(f"{type(e).__name__}: {e}", epoch)
    new = trainer._exchange(new)
    mine = trainer.objective.contributions(batch, trainer.statepoints,
                                           {i: upd.host64(o) for i, o in out.items()},
                                           upd.host64(params))
    started = time.perf_counter()
    summed = trainer.strategy.host_sum(mine)
    trainer._comm_s += time.perf_counter() - started
    grads = upd.mean_gradient(summed)
    problem = upd.failure(summed, batch, where)
    if problem:
        if not np.any(summed["nbr_overflow"]):   # non-finite: say why, where known
            notes = trainer.strategy.host_allgather_object(
                [n for i in local if not upd.finite(out[i])
                 for n in upd.diagnosis(trainer.statepoints[i], params,
                                        new.get(i, trainer.trajstates[i]), out[i])])
            notes = list(dict.fromkeys(n for part in notes for n in part))
            problem += "".join(f" Likely cause: {n}" for n in notes)
        trainer._fail(problem, epoch)
    grads = jax.tree.map(lambda g, p: jnp.asarray(g, jnp.asarray(p).dtype), grads, params)
    updates, opt_state = trainer._opt_update(grads, trainer.opt_state, params)
    trajs = {i: new.get(i, trainer.trajstates[i]) for i in local}
    scale = 1.0
    if trainer.step_size_search is not None:
        search = trainer.step_size_search
        scale, found = upd.step_size(
            [trainer.statepoints[i] for i in local], [trajs[i] for i in local],
            [float(out[i]["aux"]["n_eff"]) for i in local], params, updates,
            search.scales, search.allowed_reduction, trainer.strategy.host_sum)
        if not found:
            log.warning("Even a step scaled by %g reduces N_eff below %g of its value; "
                        "taking it.", scale, search.allowed_reduction)
    new_params = trainer._apply(params, updates, scale)
    if not bool(all_finite((new_params, opt_state))):
        # e.g. a finite gradient of 1e22 overflows Adam's float32 second
        # moment: every later step would be 0 and training silently stop
        trainer._fail(f"The update gives non-finite parameters or optimizer state in {where}, "
                      f"from a finite loss and a gradient of norm {_norm(grads):.3g}: a "
                      f"learning rate or schedule that gives NaN, or a gradient so large that "
                      f"the optimizer's moments overflow, as from a configuration where the "
                      f"potential is enormous (overlapping particles).", epoch)
    trainer.trajectories.put(new)
    reuses = trainer._reuses()
    for j, i in enumerate(batch):
        reuses[i] = 0 if summed["recomputed"][j] else reuses[i] + 1
    after = np.zeros(len(batch))
    if trainer.objective.after is not None:
        def compute():
            mine = np.zeros(len(batch))
            for j, i in enumerate(batch):
                if i in out:
                    mine[j] = trainer.objective.after(trainer.statepoints[i], params,
                                                      new_params, trajs[i], out[i], inputs[i])
            return mine
        after = trainer.strategy.host_sum(trainer._agree(
            compute, f"the objective's numbers after update {trainer.update_count}"))
    numbers = {k: list(getattr(trainer.state, k)) for k in trainer.objective.numbers}
    numbers, loss, records = trainer.objective.records(numbers, summed, after, batch,
                                                       trainer.statepoints, trainer.update_count)
    if "pred" in summed:
        trainer.predictions.update(zip(batch, summed["pred"]))
    trainer.state = trainer.state.replace(params=new_params, opt_state=opt_state, reuses=reuses,
                                          update_count=trainer.state.update_count + 1,
                                          update_losses=[*trainer.state.update_losses, loss],
                                          **numbers)
    every = trainer.consistency_check_every
    if every and trainer.update_count % every == 0:
        trainer.check_consistency()
    if trainer.on_update is not None:
        _call_on_update(trainer, {"update": trainer.update_count - 1, "epoch": epoch,
                                  "batch": list(batch), "params_before": params,
                                  "params_after": new_params, "loss": loss, "step_size": scale,
                                  "statepoints": records})
    return {"loss": loss, "step_size": scale, "statepoints": records,
            "grad_norm": _norm(grads)}


def _call_on_update(trainer, record) -> None:
    trainer._in_callback = True
    try:
        trainer.on_update(record)
    except Exception as e:
        trainer._stopped = ("callback", record["update"], type(e).__name__)
        e.add_note(f"(raised by on_update after update {record['update']}, which was "
                   f"applied)")
        raise
    finally:
        trainer._in_callback = False

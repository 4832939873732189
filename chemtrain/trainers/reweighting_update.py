"""One update of the reweighting loop (:class:`~.reweighting.Reweighting`)
with explicit inputs and outputs: :func:`apply_update` takes the loop's
fixed parts (:class:`Loop`) and the trainer's state and returns the next
state, with nothing read from or written to the trainer. It computes this
process's state points (reused or recomputed trajectories, the objective's
results), sums the objective's contributions over processes, checks the
update and takes the step with the pure functions of
:mod:`chemtrain.learn.update`, and asks the objective for its numbers after
the step. An update that must not be applied raises :class:`UpdateRefused`,
which the loop turns into its error state. Also the policies' checks and
:class:`TimedCollectives`, the timed collectives of an epoch."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..learn import update as upd
from ..learn.diagnose import all_finite
from ..learn.difftre_batches import statepoint_key, train_key
from ..learn.objective import Objective
from ..learn.reuse import ReuseRule, check_reuse, independent_samples, reuse_distance
from ..learn.update import StepSizeSearch
from ..parallel import agree
from ..simulate.restart import RestartPolicy
from ..simulate.trajectory import NeighborListOverflowError, SimulationError
from .trajectories import TrajectoryStore

log = logging.getLogger("chemtrain")


class UpdateRefused(Exception):
    """An update that must not be applied, with the reason (raised on every
    process alike: the decision is made on values summed over them)."""


def check_arguments(objective, optimizer) -> None:
    """TypeError unless ``objective`` is an :class:`~chemtrain.learn.Objective`
    and ``optimizer`` an optax ``GradientTransformation``."""
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be a chemtrain.learn.Objective, got "
                        f"{type(objective).__name__}.")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got "
                        f"{type(optimizer).__name__}.")


def check_optimizer_state(opt_state, trainer: str) -> None:
    """ValueError for the optimizer pieces only force matching runs: a
    :func:`~chemtrain.learn.optimizers.reduce_on_plateau` is fed an epoch's
    validation loss and an :func:`~chemtrain.learn.optimizers.ema` average
    is what force matching validates and exports. A reweighting update has
    neither, so both would do nothing."""
    from ..learn import optimizers
    found = [name for name, present in (
        ("chemtrain.learn.reduce_on_plateau", optimizers.has_plateau(opt_state)),
        ("chemtrain.learn.ema", optimizers.averaged(opt_state) is not None)) if present]
    if found:
        raise ValueError(f"{trainer}: the optimizer holds {' and '.join(found)}, which only "
                         f"ForceMatching (and EnsembleOfModels) feed and use: here the plateau "
                         f"would never see a loss and the average would never be simulated or "
                         f"saved. Pass the optimizer without them (e.g. an optax schedule for "
                         f"the learning rate).")


def policies(step_size_search, restart) -> tuple[StepSizeSearch | None, RestartPolicy]:
    """The loop's step-size search and restart policy from what a user
    passes: a :class:`StepSizeSearch`, True (its defaults) or None/False;
    a :class:`RestartPolicy` or None (its defaults). TypeError otherwise."""
    if step_size_search is True:
        step_size_search = StepSizeSearch()
    if step_size_search is False:
        step_size_search = None
    if step_size_search is not None and not isinstance(step_size_search, StepSizeSearch):
        raise TypeError(f"step_size_search must be a chemtrain.learn.StepSizeSearch(candidates, "
                        f"allowed_reduction), True (its defaults) or None, got "
                        f"{type(step_size_search).__name__}.")
    restart = RestartPolicy() if restart is None else restart
    if not isinstance(restart, RestartPolicy):
        raise TypeError(f"restart must be a chemtrain.simulate.RestartPolicy(capacity_multiplier, "
                        f"max_retries) or None, got {type(restart).__name__}.")
    return step_size_search, restart


def with_ratio(rule, reweight_ratio) -> ReuseRule:
    """``rule`` (a :class:`~chemtrain.learn.ReuseRule`; None: its defaults)
    with upstream chemtrain's keyword ``reweight_ratio`` (None: the rule's)."""
    rule = ReuseRule() if rule is None else rule
    if not isinstance(rule, ReuseRule):
        raise TypeError(f"reuse must be a chemtrain.learn.ReuseRule(pool, max_reuses, "
                        f"max_reuse_se, reweight_ratio) or None (its defaults), got "
                        f"{type(rule).__name__}.")
    if reweight_ratio is None:
        return rule
    check_reuse(reweight_ratio, None, None)
    if rule.reweight_ratio != ReuseRule.reweight_ratio:
        raise ValueError(f"reweight_ratio given twice: as the keyword reweight_ratio="
                         f"{reweight_ratio!r} and in reuse=ReuseRule(reweight_ratio="
                         f"{rule.reweight_ratio!r}). Give it once.")
    return dataclasses.replace(rule, reweight_ratio=float(reweight_ratio))


def reuse_rule(rule, objective) -> ReuseRule:
    """The loop's :class:`~chemtrain.learn.ReuseRule` from what a user passes
    (None: its defaults); an objective without pools (relative entropy)
    refuses a pool of more than one."""
    rule = with_ratio(rule, None)
    if not objective.pools and rule.pool not in (None, 1):
        raise ValueError(f"{objective.name} reweights one trajectory per state point, but "
                         f"reuse=ReuseRule(pool={rule.pool}) asks for a pool of {rule.pool}. "
                         f"Use pool=1 or None.")
    return rule


def pool_size(rule: ReuseRule, objective, sp) -> int:
    """State point ``sp``'s pool under ``rule`` (1 for an objective without
    pools or without the state point's timings)."""
    if not objective.pools or sp.fns.timings is None:
        return 1
    return rule.pool_size(sp.fns.timings)


class TimedCollectives:
    """A process's collectives during an epoch, timed: ``comm_s`` spent in
    exchanges and sums, ``wait_s`` waiting for the other processes' work
    (:meth:`agree`). :meth:`reset` at the start of each epoch."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.reset()

    def reset(self) -> None:
        self.comm_s = self.wait_s = 0.0

    def agree(self, compute: Callable, what: str):
        """``compute()`` on every process; if it raises on any, it raises on
        all (:func:`chemtrain.parallel.agree`)."""
        done = []

        def timed():
            result = jax.block_until_ready(compute())  # time the work, not its dispatch
            done.append(time.perf_counter())
            return result
        result = agree(self.strategy, timed, what)
        self.wait_s += time.perf_counter() - done[0]
        return result

    def timed(self, fn: Callable, *args):
        """``fn(*args)``, a collective, its time counted in ``comm_s``."""
        started = time.perf_counter()
        out = fn(*args)
        self.comm_s += time.perf_counter() - started
        return out


@dataclasses.dataclass(frozen=True)
class Loop:
    """What an update reads besides the state: the loop's fixed parts.

    Attributes:
      objective: the :class:`~chemtrain.learn.Objective`.
      statepoints: the state points, in order.
      trajectories: the :class:`~.trajectories.TrajectoryStore` (read
        here; the trainer commits an update's recomputed trajectories).
      comm: the epoch's :class:`TimedCollectives`.
      key: the run's random key.
      reuse: ``(reweight_ratio, rule)``, the reuse rule (``rule`` a
        :class:`~chemtrain.learn.reuse.ReuseRule`); the store's ``pools``
        give each state point's pool size.
      step_size_search: a :class:`StepSizeSearch` or None.
      opt_update: the optimizer's compiled ``update``.
      apply: compiled ``(params, updates, scale) -> params``.
    """

    objective: Objective
    statepoints: tuple
    trajectories: TrajectoryStore
    comm: TimedCollectives
    key: object
    reuse: tuple
    step_size_search: StepSizeSearch | None
    opt_update: Callable
    apply: Callable

    def local(self, batch) -> list:
        """The state points of ``batch`` this process computes."""
        return [batch[j] for j in self.comm.strategy.local_items(len(batch))]


def reuses_of(state, n: int) -> list:
    """Per state point, the updates that reused its trajectory since it was
    sampled (0 where a checkpoint of an older version had none)."""
    known = list(state.reuses)
    return [int(c) for c in known[:n]] + [0] * max(0, n - len(known))


def objective_states(state, objective, statepoints, params) -> list:
    """Per state point, the objective's state: the one in ``state``, or
    ``objective.init`` where it has none (a state point just added, or a
    checkpoint of a version that kept none)."""
    known = list(state.objective_state)
    return known[:len(statepoints)] + [objective.init(sp, params)
                                       for sp in statepoints[len(known):]]


#: the loop's own per-state-point numbers of an update (:func:`loop_contributions`)
LOOP_NUMBERS = ("loss", "n_eff", "n_eff_start", "pool_n_eff", "recomputed", "nbr_overflow",
                "n_independent", "reuse_se")


def loop_contributions(batch, results, params) -> dict:
    """This process's share of the loop's own numbers of an update: the
    gradient summed over its state points (float64) and, per state point of
    ``batch`` (zeros where computed elsewhere, so the sum over processes is
    the whole batch), :data:`LOOP_NUMBERS`: the loss, N_eff after and (as
    ``n_eff_start``) before a recompute, the largest N_eff of the pool's
    trajectories before it (``pool_n_eff``), whether it recomputed, the reuse
    measures of the trajectory it started from and the neighbor-list
    overflows. ``results``: state point -> host result of this process."""
    out = {"grad": jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), params),
           **{k: np.zeros(len(batch)) for k in LOOP_NUMBERS}}
    for j, i in enumerate(batch):
        if i in results:
            r = results[i]
            out["grad"] = jax.tree.map(np.add, out["grad"], r["grad"])
            for k in LOOP_NUMBERS:
                out[k][j] = r["aux"][k] if k in ("n_eff", "nbr_overflow") else r[k]
    return out


def loop_record(summed, j: int, sp, update: int) -> dict:
    """The loop's entries of state point ``sp``'s history record (position
    ``j`` of the update's batch): its index, the update, loss, N_eff before
    any recompute (of the newest trajectory; ``pool_n_eff``: the largest of
    its pool, which the reuse rule reads), snapshots, whether it recomputed
    and the reuse measures."""
    return {"statepoint": sp.index, "update": update, "loss": float(summed["loss"][j]),
            "n_eff": float(summed["n_eff_start"][j]),
            "pool_n_eff": float(summed["pool_n_eff"][j]), "n_snapshots": sp.n_snapshots,
            "recomputed": bool(summed["recomputed"][j]),
            "n_independent": float(summed["n_independent"][j]),
            "reuse_se": float(summed["reuse_se"][j])}


def local_results(loop: Loop, state, local, params):
    """The objective's result for this process's state points ``local``,
    recomputing a trajectory where the reuse rule says so; returns
    (results, inputs, new trajectories, the objective's ``derive`` of the
    pools those give)."""
    out, inputs, new, derived_new = {}, {}, {}, {}
    objective, reuses = loop.objective, reuses_of(state, len(loop.statepoints))
    (ratio, rule), store = loop.reuse, loop.trajectories
    for i in local:
        sp, trajs = loop.statepoints[i], store.states[i]
        inputs[i] = objective.inputs(sp, lambda stream, i=i: statepoint_key(
            jax.random.fold_in(loop.key, stream), i, state.update_count))
        derived = store.derived_of(objective, sp, params)
        result = objective.result(sp, params, store.sample(i), derived, inputs[i])
        n_eff_start = float(result["aux"]["n_eff"])
        n_indep = independent_samples([np.asarray(t.U_ref) for t in trajs])
        distance = reuse_distance(n_eff_start, sp.n_snapshots, n_indep)
        best = float(np.max(result["aux"].get("pool_n_eff", n_eff_start)))
        recompute = rule.recompute(best, sp.n_snapshots, ratio, n_indep, reuses[i],
                                   store.pools.get(i, 1))
        if recompute:
            keys = [train_key(loop.key, i, state.update_count, c) for c in range(len(trajs))]
            trajs = new[i] = store.run(sp, params, trajs, keys)
            derived_new[i] = store.derived_of(objective, sp, params, trajs)
            result = objective.result(sp, params, store.sample(i, trajs), derived_new[i],
                                      inputs[i])
        out[i] = dict(result, n_eff_start=n_eff_start, pool_n_eff=best, recomputed=recompute,
                      n_independent=n_indep, reuse_se=distance)
    return out, inputs, new, derived_new


def _refusal(loop: Loop, summed, batch, where, local, out, new, params) -> str | None:
    """Why the summed update must not be applied (with the likely cause of a
    non-finite result, gathered from the processes that computed it)."""
    problem = upd.failure(summed, batch, where)
    if problem and not np.any(summed["nbr_overflow"]):   # non-finite: say why, where known
        notes = loop.comm.strategy.host_allgather_object(
            [n for i in local if not upd.finite(out[i])
             for n in upd.diagnosis(loop.statepoints[i], params,
                                    new.get(i, loop.trajectories.states[i]), out[i])])
        notes = list(dict.fromkeys(n for part in notes for n in part))
        problem += "".join(f" Likely cause: {n}" for n in notes)
    return problem


def apply_update(loop: Loop, state, batch, epoch: int):
    """One update over the state points ``batch``.

    Returns:
      ``(state, report, predictions, trajectories)``: the next state, the
      update's report (``loss``, ``step_size``, ``grad_norm``,
      per-state-point ``statepoints`` records, ``params_before`` and
      ``derived``: the objective's ``derive`` of the pools this process's
      recomputed trajectories give, for the store with them), the
      objective's predictions of the batch's state points (state point ->
      predictions, where it has any) and the recomputed trajectories (state
      point -> one per chain, on every process), which the caller commits
      to its store (:meth:`~.trajectories.TrajectoryStore.put`); nothing in
      ``loop.trajectories`` is replaced here.

    Raises:
      UpdateRefused: a simulation failed, the summed result is not finite
        or overflowed a neighbor list, or the step gives non-finite
        parameters; nothing was changed.
    """
    params, local, comm = state.params, loop.local(batch), loop.comm
    where = f"update {state.update_count} (epoch {epoch}, state points {batch})"
    try:
        out, inputs, new, derived = comm.agree(
            lambda: local_results(loop, state, local, params),
            f"computing update {state.update_count}")
    except (NeighborListOverflowError, SimulationError) as e:
        raise UpdateRefused(f"{type(e).__name__}: {e}") from e
    new = comm.timed(loop.trajectories.exchange, loop.statepoints, params, new)
    host = {i: upd.host64(o) for i, o in out.items()}
    summed = comm.timed(comm.strategy.host_sum, {
        "loop": loop_contributions(batch, host, upd.host64(params)),
        "objective": loop.objective.contributions(batch, loop.statepoints, host)})
    own, summed = summed["objective"], summed["loop"]
    grads = upd.mean_gradient(summed)
    problem = _refusal(loop, summed, batch, where, local, out, new, params)
    if problem:
        raise UpdateRefused(problem)
    grads = jax.tree.map(lambda g, p: jnp.asarray(g, jnp.asarray(p).dtype), grads, params)
    updates, opt_state = loop.opt_update(grads, state.opt_state, params)
    trajs = {i: new.get(i, loop.trajectories.states[i]) for i in local}
    scale, search = 1.0, loop.step_size_search
    if search is not None:
        scale, found = upd.step_size(
            [loop.statepoints[i] for i in local], [trajs[i] for i in local],
            [float(out[i]["aux"]["n_eff"]) for i in local], params, updates,
            search.scales, search.allowed_reduction, comm.strategy.host_sum)
        if not found:
            log.warning("Even a step scaled by %g reduces N_eff below %g of its value; "
                        "taking it.", scale, search.allowed_reduction)
    new_params = loop.apply(params, updates, scale)
    if not bool(all_finite((new_params, opt_state))):
        # e.g. a finite gradient of 1e22 overflows Adam's float32 second
        # moment: every later step would be 0 and training silently stop
        raise UpdateRefused(
            f"The update gives non-finite parameters or optimizer state in {where}, from a "
            f"finite loss and a gradient of norm {upd.global_norm(grads):.3g}: a learning rate "
            f"or schedule that gives NaN, or a gradient so large that the optimizer's moments "
            f"overflow, as from a configuration where the potential is enormous (overlapping "
            f"particles).")
    reuses = reuses_of(state, len(loop.statepoints))
    for j, i in enumerate(batch):
        reuses[i] = 0 if summed["recomputed"][j] else reuses[i] + 1
    after = np.zeros(len(batch))
    if loop.objective.after is not None:
        def compute():
            mine = np.zeros(len(batch))
            for j, i in enumerate(batch):
                if i in out:
                    mine[j] = loop.objective.after(loop.statepoints[i], params, new_params,
                                                   trajs[i], out[i], inputs[i])
            return mine
        after = comm.strategy.host_sum(comm.agree(
            compute, f"the objective's numbers after update {state.update_count}"))
    states = objective_states(state, loop.objective, loop.statepoints, params)
    states, loss, mine = loop.objective.records(states, dict(own, loss=summed["loss"]), after,
                                                batch, loop.statepoints)
    records = {i: {**loop_record(summed, j, loop.statepoints[i], state.update_count),
                   **mine.get(i, {})} for j, i in enumerate(batch)}
    predictions = dict(zip(batch, own["pred"])) if "pred" in own else {}
    state = state.replace(params=new_params, opt_state=opt_state, reuses=reuses,
                          update_count=state.update_count + 1, objective_state=list(states),
                          update_losses=[*state.update_losses, loss])
    return state, {"loss": loss, "step_size": scale, "statepoints": records,
                   "grad_norm": upd.global_norm(grads), "params_before": params,
                   "derived": derived}, predictions, new

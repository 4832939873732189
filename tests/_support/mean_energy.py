"""A third reweighting objective, written outside the loop (issue 32): match
each state point's reweighted mean potential energy to a target."""
import jax
import jax.numpy as jnp
import numpy as np

from chemtrain.learn import Objective, reuse_record, shared_contributions
from chemtrain.learn.difftre import (effective_sample_size, make_snapshot_evaluator,
                                     reweighting_weights)
from chemtrain.learn.update import chains_of, energies_of


def mean_energy_objective(energy_fn_template, targets):
    """``targets[i]``: state point i's target mean energy (kJ/mol); its loss
    is (<U>_theta - target)^2, <U>_theta reweighted from its trajectory."""
    evaluate = make_snapshot_evaluator(energy_fn_template, None, None)

    def loss(params, chains, U_ref, state_kwargs, target):
        U, _, overflow = evaluate(params, chains, state_kwargs)
        w = reweighting_weights(U, U_ref, state_kwargs["kT"])
        mean = jnp.sum(w * U)
        return (mean - target) ** 2, {"n_eff": effective_sample_size(w),
                                      "nbr_overflow": overflow, "mean": mean}
    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))

    def result(sp, params, trajs, derived, inputs):
        (value, aux), grad = value_and_grad(params, chains_of(trajs), energies_of(trajs),
                                            sp.state_kwargs, targets[sp.index])
        return {"loss": value, "aux": aux, "grad": grad}

    def contributions(batch, statepoints, results, params):
        out = shared_contributions(batch, results, params)
        out["mean"] = np.array([float(results[i]["aux"]["mean"]) if i in results else 0.0
                                for i in batch])
        return out

    def records(numbers, summed, after, batch, statepoints, update):
        recs = {i: dict(reuse_record(summed, j, statepoints[i], update),
                        loss=float(summed["loss"][j]), mean_energy=float(summed["mean"][j]))
                for j, i in enumerate(batch)}
        return numbers, float(np.mean(summed["loss"])), recs

    return Objective("mean energy", result, contributions, records)

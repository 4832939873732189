"""A third reweighting objective, written against ``Objective`` alone (issue
53): match each state point's reweighted mean potential energy to its target
``target_values["mean_energy"]``."""
import jax
import jax.numpy as jnp
import numpy as np

from chemtrain.learn import Objective
from chemtrain.learn.reweighting import (effective_sample_size, make_snapshot_evaluator,
                                     reweighting_weights)
from chemtrain.learn.update import chains_of, energies_of


def mean_energy_objective():
    """The loss of a state point is (<U>_theta - target)^2, <U>_theta
    reweighted from its trajectory to the current parameters."""
    def prepare(fns, spec):   # compiled once per group of state points
        evaluate = make_snapshot_evaluator(fns.energy_fn_template, None, None)

        def loss(params, chains, U_ref, state_kwargs, target):
            U, _, overflow = evaluate(params, chains, state_kwargs)
            w = reweighting_weights(U, U_ref, state_kwargs["kT"])
            mean = jnp.sum(w * U)
            return (mean - target) ** 2, {"n_eff": effective_sample_size(w),
                                          "nbr_overflow": overflow, "mean": mean}
        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    def result(sp, params, trajs, derived, inputs):
        (value, aux), grad = sp.functions(params, chains_of(trajs), energies_of(trajs),
                                          sp.state_kwargs, sp.target_values["mean_energy"])
        return {"loss": value, "aux": aux, "grad": grad}

    def contributions(batch, statepoints, results):
        return {"mean": np.array([float(results[i]["aux"]["mean"]) if i in results else 0.0
                                  for i in batch])}

    def records(states, summed, after, batch, statepoints):
        return (states, float(np.mean(summed["loss"])),
                {i: {"mean_energy": float(summed["mean"][j])} for j, i in enumerate(batch)})

    return Objective("mean energy", result, records, prepare=prepare,
                     contributions=contributions)

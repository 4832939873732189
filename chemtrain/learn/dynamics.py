"""Learning from dynamics (issue 48): dynamic observables as averages over a
state point's canonical start states of functionals of short NVE segments
(Han and Yu, Nat. Commun. 16, 2025), and their exact gradient.

A dynamic observable is ``O = sum_i w_i(theta) o_i(theta)``: the start
states are the stored snapshots (positions and momenta) of a state point's
trajectory, reweighted to the current parameters (``w_i``, DiffTRe's
weights), and ``o_i`` a functional of the NVE segment started from snapshot
``i`` under the current potential (e.g. its Green-Kubo diffusion
coefficient). Its gradient has two parts: the start-state distribution's
(through ``w_i``) and the segment's own (through ``o_i``, by reverse mode
through the integrator). :func:`make_value_and_grad` computes both exactly,
or the segment's part truncated to windows of ``backprop_steps`` steps
(:func:`make_segment`): in a chaotic liquid the exact one through long
segments is mostly noise.

**Memory.** The segment (:func:`make_segment`) is jax-md's velocity-Verlet
NVE integrator in a scan over blocks of steps, with gradient checkpointing
at two levels: the reverse pass keeps only the simulator state at block
boundaries and, while one block is reversed, at its steps, and recomputes
each step's forces when it is reversed. So the memory of a segment's
gradient grows with ``n_steps / block + block`` simulator states (about
``2 sqrt(n_steps)`` at the default block) instead of with every step's
intermediates; a simulator state of 864 argon atoms is 83 kB. The cost is
one more forward pass per level (about four forward passes per gradient
instead of two). A reversible integrator would keep less, but reversing a
chaotic liquid's trajectory in floating point diverges within picoseconds,
so its gradients would be wrong; checkpointing is exact.

**Two passes.** ``w_i`` needs every ``o_i`` before the loss's cotangent is
known, so the loss and gradient take two passes over the start states: the
observables first (forward only), then, one start state after another, the
segment's vector-Jacobian product with the cotangent scaled by ``w_i``, so
peak memory holds one segment's reverse pass, not all of them.

Units are chemtrain's: nm, ps, amu, kJ/mol.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from ..ensemble import ENSEMBLE_KEYS, volume
from ..quantity import dynamics as dq
from . import reweighting as reweight


def block_size(n_steps: int, window: int | None = None) -> int:
    """The divisor ``b`` of ``n_steps`` (and of ``window`` if given) that
    minimises ``n_steps / b + b``: the simulator states the checkpointed
    reverse pass keeps."""
    divisors = [b for b in range(1, n_steps + 1)
                if n_steps % b == 0 and (window is None or window % b == 0)]
    return min(divisors, key=lambda b: (n_steps // b + b, b))


def make_segment(energy_fn_template: Callable, shift_fn: Callable, dt: float, n_steps: int,
                 block: int | None = None, stress_box=None,
                 neighbors: bool = True, backprop_steps: int | None = None) -> Callable:
    """An NVE segment of ``n_steps`` velocity-Verlet steps of ``dt`` ps,
    differentiable with memory that grows with ``sqrt(n_steps)``.

    Args:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``
        (kJ/mol).
      shift_fn: jax-md's shift function of the box.
      dt: the time step (ps).
      n_steps: steps per segment.
      block: steps per checkpointed block (a divisor of ``n_steps``; None:
        :func:`block_size`).
      stress_box: the periodic box (nm: a side, sides or a matrix) to also
        record the stress tensor's off-diagonal components at every step
        (for the shear viscosity, :func:`shear_viscosity`); its virial part
        is the strain derivative through the energy function's
        ``perturbation`` keyword, as for :func:`chemtrain.quantity.pressure`.
        None: no stress (it costs about one more backward pass per step).
      neighbors: False for a potential that ignores its neighbor list (e.g.
        ``lennard_jones_template(..., all_pairs=True)``): the segment then
        neither passes nor updates one, which vmapped segments
        (``segment_batch``) would otherwise rebuild at every step.
      backprop_steps: truncated backpropagation through time. None (the
        default): the exact gradient. A whole number ``k``: the state
        (positions, momenta, displacements) after every ``k`` steps is held
        constant in the reverse pass, its forces computed again from the
        held positions under the current parameters, so the gradient of a
        value at step ``t`` follows the dynamics back at most to step
        ``k * floor((t - 1) / k)``. The forward pass is the same up to
        rounding. ``k`` must be a multiple of ``block`` (None picks a block
        that divides both). In a chaotic liquid the exact gradient through a
        long segment grows with its length and is mostly noise
        (``benchmarks/dynamics_gradient_coherence.py``, water beads: the
        cosine between the gradients of two independent sets of starts is
        +0.98 for 0.25 ps segments and -0.23 for 1 ps ones, and +0.89 for
        1 ps ones truncated to 0.25 ps). A truncated gradient is biased: it
        leaves out how a change early in a segment moves what comes more
        than ``k`` steps later.

    Returns:
      ``segment(params, position, momentum, mass, nbrs, kwargs) -> (series,
      overflow)``: from positions (N, dim, nm) and momenta (amu nm/ps),
      masses (amu, scalar or (N,)) and a neighbor list of the start (None:
      a potential without one), the
      series ``{'vacf': (n_steps + 1,) nm^2/ps^2, 'msd': (n_steps + 1,)
      nm^2}`` at t = 0, dt, ... (with ``stress_box`` also ``'stress'``:
      (n_steps + 1, 3), the xy, xz and yz components in kJ/mol/nm^3), and
      whether the neighbor list overflowed.
      ``kwargs`` go to the energy function (e.g. ``species``).

    Raises:
      ValueError: ``n_steps``, ``block`` or ``backprop_steps`` not a
        positive whole number, or a block that does not divide ``n_steps``
        (and ``backprop_steps``).
    """
    from jax_md import quantity, simulate
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive whole number, got {n_steps!r}.")
    if backprop_steps is not None and (isinstance(backprop_steps, bool)
                                       or not isinstance(backprop_steps, int)
                                       or backprop_steps < 1):
        raise ValueError(f"backprop_steps must be None (the exact gradient) or a positive whole "
                         f"number of steps, got {backprop_steps!r}.")
    cut_every = None if backprop_steps is None or backprop_steps >= n_steps else backprop_steps
    default = block_size(n_steps, cut_every)
    block = default if block is None else block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or n_steps % block \
            or (cut_every is not None and cut_every % block):
        within = "" if cut_every is None else f" and of backprop_steps={cut_every}"
        raise ValueError(f"block must be a positive divisor of n_steps={n_steps}{within}, got "
                         f"{block!r} (None picks {default}).")

    def segment(params, position, momentum, mass, nbrs, kwargs):
        nbrs = nbrs if neighbors else None
        energy_fn = energy_fn_template(params)
        init_fn, step_fn = simulate.nve(energy_fn, shift_fn, dt)
        state = init_fn(None, position, 0.0, mass=mass, momenta=momentum, neighbor=nbrs,
                        **kwargs)
        v0 = state.velocity
        force_fn = quantity.canonicalize_force(energy_fn)

        def record(state, nbrs, disp):
            out = (dq.velocity_autocorrelation(v0, state.velocity),
                   dq.mean_squared_displacement(disp))
            if stress_box is None:
                return out
            return out + (_shear_stress(energy_fn, state, nbrs, stress_box, kwargs),)

        def step(carry, _):
            state, nbrs, disp, overflow = carry
            # velocity Verlet moves each particle by dt (p + dt F / 2) / m
            disp = disp + dt * (state.momentum + 0.5 * dt * state.force) / state.mass
            state = step_fn(state, neighbor=nbrs, **kwargs)
            if nbrs is not None:
                nbrs = nbrs.update(state.position)
                overflow = overflow | (nbrs.did_buffer_overflow > 0)
            return (state, nbrs, disp, overflow), record(state, nbrs, disp)

        def restart(state, nbrs, disp):
            """The same state as a constant of the parameters: its forces
            again, from the held positions and the current parameters."""
            state, disp = jax.lax.stop_gradient((state, disp))
            return state.set(force=force_fn(state.position, neighbor=nbrs, **kwargs)), disp

        def run_block(carry, b):
            state, nbrs, disp, overflow = carry
            if cut_every is not None:   # truncated backpropagation
                state, disp = jax.lax.cond((b > 0) & (b * block % cut_every == 0), restart,
                                           lambda s, _, d: (s, d), state, nbrs, disp)
            return jax.lax.scan(jax.checkpoint(step), (state, nbrs, disp, overflow), None,
                                length=block)

        start = (state, nbrs, jnp.zeros_like(position), jnp.asarray(False))
        (_, _, _, overflow), ys = jax.lax.scan(jax.checkpoint(run_block), start,
                                               jnp.arange(n_steps // block))
        first = record(state, nbrs, start[2])
        series = {k: jnp.concatenate([a[None], b.reshape(-1, *a.shape)])
                  for k, a, b in zip(("vacf", "msd", "stress"), first, ys)}
        return series, overflow
    segment.n_steps, segment.dt, segment.block = n_steps, dt, block
    segment.backprop_steps = backprop_steps
    return segment


def _shear_stress(energy_fn, state, nbrs, box, kwargs):
    """The xy, xz, yz components of the stress tensor (kJ/mol/nm^3): the
    kinetic part plus the strain derivative of the energy, over the volume."""
    R, dim = state.position, state.position.shape[-1]
    eye = jnp.eye(dim, dtype=R.dtype)
    dU = jax.grad(lambda eps: energy_fn(R, neighbor=nbrs, perturbation=eye + eps, **kwargs))(
        jnp.zeros((dim, dim), R.dtype))
    v = state.velocity
    kinetic = jnp.einsum("i,ia,ib->ab", jnp.broadcast_to(jnp.ravel(state.mass), R.shape[:1]),
                         v, v)
    sigma = (kinetic - dU) / volume(box, dim)
    return jnp.stack([sigma[0, 1], sigma[0, 2], sigma[1, 2]])


def diffusion(dim: int = 3, method: str = "green_kubo") -> Callable:
    """The segment functional of the self-diffusion coefficient (nm^2/ps):
    ``fn(series, dt) -> D``.

    Args:
      dim: the number of dimensions.
      method: ``'green_kubo'`` (the integral of the velocity
        autocorrelation, :func:`chemtrain.quantity.green_kubo_diffusion`)
        or ``'einstein'`` (the slope of the mean squared displacement over
        the segment's second half, :func:`chemtrain.quantity.einstein_diffusion`).
    """
    if method == "green_kubo":
        return lambda series, dt: dq.green_kubo_diffusion(series["vacf"], dt, dim)
    if method == "einstein":
        return lambda series, dt: dq.einstein_diffusion(series["msd"], dt, dim=dim)
    raise ValueError(f"method must be 'green_kubo' or 'einstein', got {method!r}.")


def shear_viscosity(box, kT: float) -> Callable:
    """The segment functional of the Green-Kubo shear viscosity
    ``eta = V / kT integral <P_ab(0) P_ab(t)> dt`` over the off-diagonal
    components, in kJ/mol/nm^3 ps (x
    :data:`chemtrain.quantity.KJ_PER_MOL_NM3_PS_TO_MPA_S` for mPa s): ``fn(series, dt)``.
    It needs a segment made with ``stress_box``; a single start gives a noisy
    estimate, so average over many.

    Args:
      box: the periodic box (nm), as given to the segment.
      kT: the state point's thermal energy (kJ/mol).
    """
    def fn(series, dt):
        p = series["stress"]
        return dq.green_kubo_viscosity(jnp.mean(p[:1] * p, axis=-1), dt, volume(box, p.shape[-1]),
                                       kT)
    return fn


def start_states(chains):
    """Every stored snapshot of every chain, in chain order, as start states:
    ``(positions, momenta, nbrs)`` with a leading start-state axis; ``nbrs``
    the first chain's list (rebuilt at each start)."""
    snapshots = [c[0] for c in chains]
    R = jnp.concatenate([s.position for s in snapshots])
    P = jnp.concatenate([s.momentum for s in snapshots])
    return R, P, chains[0][1]


def make_value_and_grad(energy_fn_template: Callable, segment: Callable,
                        functionals: Mapping[str, Callable], loss_fn: Callable,
                        vmap_batch: int | None = 10, segment_batch: int = 1) -> Callable:
    """The loss of dynamic observables and its exact gradient.

    Args:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``.
      segment: :func:`make_segment` of the same template.
      functionals: ``{name: fn(series, dt) -> value}`` per segment (e.g.
        :func:`diffusion`); the observable is the reweighted mean over the
        start states.
      loss_fn: ``(observables, targets) -> (loss, parts)``, a scalar and
        a dict of its parts (e.g. :func:`squared_error`).
      vmap_batch: snapshots whose energies are evaluated at once.
      segment_batch: start states whose segments run at once (vmapped), in
        both passes; memory grows with the batch. 1 (the default) runs them
        one after another. Measured (``benchmarks/argon_costs.py``, 864
        atoms): vmapped segments on a neighbor list rebuild it at every
        step and are slower (4x on a TPU, 3-4x on a CPU); without a list
        (``make_segment(..., neighbors=False)``) a batch of 10 gains about
        10 % on a TPU. The gradient is the same up to rounding.

    Returns:
      ``value_and_grad(params, chains, U_ref, targets, state_kwargs) ->
      ((loss, aux), grad)``; ``chains`` the stored trajectories as
      ``(snapshots, nbrs)`` per chain (their snapshots are the start
      states), ``U_ref`` their reference energies. ``aux``: ``predictions``
      (the observables), ``per_start`` (each start state's values),
      ``weights``, ``n_eff`` and ``nbr_overflow`` (segments or snapshots
      whose neighbor list overflowed).
    """
    if isinstance(segment_batch, bool) or not isinstance(segment_batch, int) \
            or segment_batch < 1:
        raise ValueError(f"segment_batch must be a positive whole number (start states whose "
                         f"segments run at once), got {segment_batch!r}.")
    evaluate = reweight.make_snapshot_evaluator(energy_fn_template, None, vmap_batch)

    def observe(params, R, P, nbrs0, state_kwargs):
        nbrs = nbrs0.update(R)
        kwargs = {k: v for k, v in state_kwargs.items() if k not in ENSEMBLE_KEYS}
        series, overflow = segment(params, R, P, state_kwargs.get("mass", 1.0), nbrs, kwargs)
        values = {k: fn(series, segment.dt) for k, fn in functionals.items()}
        return values, overflow | nbrs.did_buffer_overflow

    def value_and_grad(params, chains, U_ref, targets, state_kwargs):
        R, P, nbrs0 = start_states(chains)
        per_start, overflow = jax.lax.map(
            lambda rp: observe(params, rp[0], rp[1], nbrs0, state_kwargs), (R, P),
            batch_size=None if segment_batch == 1 else min(segment_batch, R.shape[0]))
        per_start = jax.lax.stop_gradient(per_start)

        def mixture(p):
            U, _, n_over = evaluate(p, chains, state_kwargs)
            w = reweight.reweighting_weights(U, U_ref, state_kwargs["kT"])
            return {k: jnp.tensordot(w, v, axes=(0, 0)) for k, v in per_start.items()}, (w, n_over)

        observables, start_vjp, (w, n_over) = jax.vjp(mixture, params, has_aux=True)
        loss, loss_vjp, parts = jax.vjp(lambda o: loss_fn(o, targets), observables,
                                        has_aux=True)
        cot = loss_vjp(jnp.ones_like(loss))[0]
        grad_start = start_vjp(cot)[0]

        def segment_grad(r, p, wi):
            _, vjp = jax.vjp(lambda q: observe(q, r, p, nbrs0, state_kwargs)[0], params)
            return vjp(jax.tree.map(lambda c: wi * c, cot))[0]

        def add_segment(total, item):
            g = segment_grad(*item)
            return jax.tree.map(jnp.add, total, g), None

        def add_batch(total, item):
            g = jax.vmap(segment_grad)(*item)
            return jax.tree.map(lambda t, x: t + jnp.sum(x, axis=0), total, g), None

        zero = jax.tree.map(jnp.zeros_like, params)
        if segment_batch == 1:
            grad_segments, _ = jax.lax.scan(add_segment, zero, (R, P, w))
        else:   # padded start states repeat the last one with weight 0
            batch = min(segment_batch, R.shape[0])
            grad_segments, _ = jax.lax.scan(add_batch, zero, (
                *reweight.pad_to_chunks((R, P), batch), reweight.pad_to_chunks(w, batch,
                                                                               "zeros")))
        grad = jax.tree.map(jnp.add, grad_start, grad_segments)
        aux = {"predictions": observables, "per_start": per_start, "weights": w,
               "n_eff": reweight.effective_sample_size(w), "parts": parts,
               "nbr_overflow": jnp.sum(overflow) + n_over}
        return (loss, aux), grad
    return value_and_grad


def squared_error(scales: Mapping[str, float] | None = None) -> Callable:
    """``loss(observables, targets) -> (loss, parts)``: the sum over targets
    of ``gamma x mean((observable - target)^2)``, ``gamma`` from ``scales``
    (default 1), and each target's part."""
    scales = dict(scales or {})

    def loss(observables, targets):
        parts = {k: jnp.mean((observables[k] - targets[k]) ** 2) for k in targets}
        return sum(scales.get(k, 1.0) * v for k, v in parts.items()), parts
    return loss


def check_steps(dt: float, duration: float) -> int:
    """Steps of ``dt`` ps in a segment of ``duration`` ps (a whole number of
    steps, else ValueError)."""
    n = duration / dt
    if not (math.isfinite(n) and n >= 1 and abs(n - round(n)) < 1e-6 * max(1.0, n)):
        raise ValueError(f"A segment of {duration} ps is not a whole number of steps of "
                         f"{dt} ps; choose a duration that is a multiple of dt.")
    return int(round(n))

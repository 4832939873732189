"""Sample configurations with jax-md's Langevin integrator and label them.

Used for the demo's embedded data and for tests: a reference energy function
is simulated, frames are stored, and energies and forces of the same function
become the training targets.
"""
from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("chemtrain")


def sample_langevin(energy_fn: Callable, neighbor_fn, shift_fn: Callable, R0, *, kT: float,
                    dt: float, n_frames: int, steps_per_frame: int, mass: float = 1.0,
                    gamma: float = 1.0, n_equilibration: int = 0, seed: int = 0) -> np.ndarray:
    """Run NVT Langevin dynamics and return ``n_frames`` positions (frames, N, 3).

    jax-md's ``simulate.nvt_langevin`` integrates in chunks of
    ``steps_per_frame`` steps. The neighbor list is updated every step and
    re-allocated (and the chunk re-run) if it overflows.

    Args:
      energy_fn: ``energy_fn(R, neighbor)``, the potential energy in kJ/mol.
      neighbor_fn: jax-md ``NeighborListFns``; first allocated at ``R0``.
      shift_fn: jax-md shift function of the simulation space.
      R0: (N, 3) initial positions in nm.
      kT: thermal energy in kJ/mol.
      dt: time step in ps.
      n_frames: number of frames returned.
      steps_per_frame: steps between two stored frames.
      mass: particle mass in amu.
      gamma: friction coefficient of the thermostat in 1/ps.
      n_equilibration: steps run before the first frame, rounded down to a
        multiple of ``steps_per_frame``.
      seed: seed of the JAX random key.

    Returns:
      numpy array (n_frames, N, 3) of positions in nm, one frame every
      ``steps_per_frame`` steps after equilibration.
    """
    from jax_md import simulate
    init, apply = simulate.nvt_langevin(energy_fn, shift_fn, dt=dt, kT=kT, gamma=gamma)
    nbrs = neighbor_fn.allocate(R0)
    state = init(jax.random.PRNGKey(seed), R0, mass=mass, neighbor=nbrs)

    @jax.jit
    def chunk(state, nbrs):
        def body(carry, _):
            state, nbrs = carry
            state = apply(state, neighbor=nbrs)
            nbrs = nbrs.update(state.position)
            return (state, nbrs), None
        (state, nbrs), _ = jax.lax.scan(body, (state, nbrs), None, length=steps_per_frame)
        return state, nbrs

    frames = []
    n_chunks = n_equilibration // steps_per_frame + n_frames
    k = 0
    while k < n_chunks:
        new_state, new_nbrs = chunk(state, nbrs)
        if new_nbrs.did_buffer_overflow:
            log.info("neighbor list overflowed while sampling; re-allocating")
            nbrs = neighbor_fn.allocate(state.position)
            continue
        state, nbrs = new_state, new_nbrs
        if k >= n_chunks - n_frames:
            frames.append(np.asarray(state.position))
        k += 1
    return np.stack(frames)


def label_frames(energy_fn: Callable, neighbor_fn, frames) -> dict:
    """Energies ``U`` and forces ``F`` of ``energy_fn(R, neighbor)`` per frame.

    One neighbor list is allocated at the first frame (with
    ``extra_capacity=8``) and updated for each frame.

    Args:
      energy_fn: ``energy_fn(R, neighbor)``, the potential energy in kJ/mol.
      neighbor_fn: jax-md ``NeighborListFns``.
      frames: (frames, N, 3) positions in nm.

    Returns:
      A dict of numpy arrays, ``R`` (frames, N, 3) in nm (the frames), ``U``
      (frames,) in kJ/mol and ``F = -dU/dR`` (frames, N, 3) in kJ/mol/nm.

    Raises:
      RuntimeError: the neighbor list overflowed while labelling a frame.
    """
    nbrs = neighbor_fn.allocate(jnp.asarray(frames[0]), extra_capacity=8)

    @jax.jit
    def one(R):
        nb = nbrs.update(R)
        U, dU = jax.value_and_grad(lambda r: energy_fn(r, neighbor=nb))(R)
        return U, -dU, nb.did_buffer_overflow

    U, F, bad = jax.lax.map(one, jnp.asarray(frames))
    if bool(jnp.any(bad)):
        raise RuntimeError("Neighbor list overflow while labelling frames.")
    return {"R": np.asarray(frames), "U": np.asarray(U), "F": np.asarray(F)}


def lj_fluid_dataset(n_particles: int = 64, density: float = 21.0, temperature: float = 120.0,
                     n_frames: int = 200, steps_per_frame: int = 20, sigma: float = 0.34,
                     epsilon: float = 0.99, r_cutoff: float = 0.9, seed: int = 0,
                     dtype=jnp.float32):
    """A labelled argon-like Lennard-Jones fluid in a cubic periodic box.

    Units nm, kJ/mol, ps, amu. The particles start on a cubic lattice, are
    sampled by :func:`sample_langevin` (time step 0.005 ps, mass 39.95 amu,
    friction 5/ps, 400 equilibration steps) and are labelled by
    :func:`label_frames` with the Lennard-Jones energy of
    :func:`chemtrain.models.lennard_jones_template`, cut off at ``r_cutoff``.

    Args:
      n_particles: number of particles.
      density: number density in particles per nm^3.
      temperature: temperature in K.
      n_frames: number of frames.
      steps_per_frame: integration steps between two frames.
      sigma: Lennard-Jones sigma in nm.
      epsilon: Lennard-Jones epsilon in kJ/mol.
      r_cutoff: cutoff of the potential and of the neighbor list in nm.
      seed: seed of the sampling.
      dtype: dtype of the positions and of the parameters.

    Returns:
      A tuple ``(dataset, box_size, template, params)``, the dataset (the dict
      of ``R``, ``U`` and ``F`` of :func:`label_frames`), the box side length
      in nm (a float), the energy template used for labelling and its
      parameters ``{'sigma', 'epsilon'}``.
    """
    from jax_md import partition, space
    from ..models.pair import lennard_jones_template
    from ..units import kT
    box = float((n_particles / density) ** (1.0 / 3.0))
    displacement, shift = space.periodic(box)
    per_side = int(np.ceil(n_particles ** (1 / 3)))
    grid = (np.stack(np.meshgrid(*[np.arange(per_side)] * 3, indexing="ij"), -1)
            .reshape(-1, 3)[:n_particles] + 0.5) * box / per_side
    R0 = jnp.asarray(grid, dtype)
    template = lennard_jones_template(displacement, r_cutoff)
    params = {"sigma": jnp.asarray(sigma, dtype), "epsilon": jnp.asarray(epsilon, dtype)}
    energy_fn = template(params)
    neighbor_fn = partition.neighbor_list(displacement, box, r_cutoff, dr_threshold=0.05,
                                          capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    frames = sample_langevin(energy_fn, neighbor_fn, shift, R0, kT=kT(temperature), dt=0.005,
                             n_frames=n_frames, steps_per_frame=steps_per_frame, mass=39.95,
                             gamma=5.0, n_equilibration=400, seed=seed)
    return label_frames(energy_fn, neighbor_fn, frames), box, template, params

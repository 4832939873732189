"""chemtrain.quantity against independent codes on the same frames: ASE's
smooth Lennard-Jones stress and energy, ASE's RDF histogram, and brute-force
numpy triplet angles."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, simulate, space

from chemtrain import quantity
from chemtrain.models.pair import (harmonic_bond_template, init_pair_mlp, lennard_jones_template,
                                   pair_mlp_template)

# The argon-like fluid of the DiffTRe issue: 128 particles at 21 nm^-3.
N, DENSITY, SIGMA, EPSILON, MASS, R_CUT = 128, 21.0, 0.34, 0.99, 39.95, 0.9
BOX = (N / DENSITY) ** (1.0 / 3.0)   # 1.827 nm > 2 R_CUT, as ASE's get_rdf requires


def _frames(n_frames=3, seed=0):
    """Disordered frames: a simple-cubic-like lattice with Gaussian noise
    (no overlaps), plus random momenta."""
    rng = np.random.default_rng(seed)
    per = int(np.ceil(N ** (1 / 3)))
    grid = (np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1)
            .reshape(-1, 3)[:N] + 0.5) * BOX / per
    R = np.mod(grid[None] + 0.04 * rng.standard_normal((n_frames, N, 3)), BOX)
    P = np.sqrt(MASS * 1.0) * rng.standard_normal((n_frames, N, 3))
    return R, P


def _state(R, P):
    return simulate.NVTLangevinState(jnp.asarray(R), jnp.asarray(P), jnp.zeros_like(R),
                                     jnp.full((N, 1), MASS), jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def lj():
    displacement, _ = space.periodic(BOX)
    neighbor_fn = partition.neighbor_list(displacement, BOX, R_CUT, dr_threshold=0.01,
                                          format=partition.Sparse)
    template = lennard_jones_template(displacement, R_CUT)
    energy_fn = template({"sigma": SIGMA, "epsilon": EPSILON})
    R, P = _frames()
    nbrs = neighbor_fn.allocate(jnp.asarray(R[0]), extra_capacity=4)
    return displacement, neighbor_fn, energy_fn, R, P, nbrs


def _ase_atoms(R, P=None):
    from ase import Atoms
    from ase.calculators.lj import LennardJones
    atoms = Atoms(f"Ar{N}", positions=R, cell=[BOX] * 3, pbc=True)
    atoms.set_masses(np.full(N, MASS))
    if P is not None:
        atoms.set_momenta(P)
    # chemtrain's template switches off between 0.9 r_cut and r_cut with the
    # same polynomial as ASE's smooth mode; ASE is unit-agnostic (nm, kJ/mol here).
    atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPSILON, rc=R_CUT, ro=0.9 * R_CUT, smooth=True)
    return atoms


def test_pressure_and_energy_match_ase(lj):
    displacement, _, energy_fn, R, P, nbrs = lj
    fns = {"full": quantity.pressure(BOX), "conf": quantity.pressure(BOX, include_kinetic=False),
           "U": quantity.potential_energy()}
    evaluate = jax.jit(lambda s, nb: {k: f(s, neighbor=nb, energy_fn=energy_fn)
                                      for k, f in fns.items()})
    for R_k, P_k in zip(R, P):
        state = _state(R_k, P_k)
        nb = nbrs.update(state.position)
        assert not nb.did_buffer_overflow
        atoms = _ase_atoms(R_k, P_k)
        # ASE: stress = (1/V) dE/d(strain) (+ kinetic part -sum p p^T / m V); pressure = -tr/3
        ase_conf = -np.trace(atoms.get_stress(voigt=False, include_ideal_gas=False)) / 3
        ase_full = -np.trace(atoms.get_stress(voigt=False, include_ideal_gas=True)) / 3
        ours = evaluate(state, nb)
        assert float(ours["conf"]) == pytest.approx(ase_conf, rel=1e-3)
        assert float(ours["full"]) == pytest.approx(ase_full, rel=1e-3)
        assert abs(ase_full - ase_conf) > 1.0   # the kinetic part is really tested
        assert float(ours["U"]) == pytest.approx(atoms.get_potential_energy(), rel=1e-6)


def test_rdf_matches_ase_histogram(lj):
    from ase.geometry.rdf import get_rdf
    displacement, _, _, R, P, nbrs = lj
    params = quantity.rdf_discretization(R_CUT, nbins=90)
    rdf_fn = jax.jit(lambda s, nb: quantity.rdf(displacement, params, BOX)(s, neighbor=nb))
    centers, edges = np.asarray(params.bin_centers), np.asarray(params.bin_edges)
    shells = 4 / 3 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)
    for R_k, P_k in zip(R, P):
        state = _state(R_k, P_k)
        ours = np.asarray(rdf_fn(state, nbrs.update(state.position)))
        # ASE's plain histogram on bins fine enough that every pair sits at its
        # distance; turned back into ordered pair counts (ASE divides by
        # N * rho * shell) and smoothed with the same Gaussian.
        n_fine = 90_000
        g_fine, r_fine = get_rdf(_ase_atoms(R_k), R_CUT, n_fine)
        e_fine = np.linspace(0.0, R_CUT, n_fine + 1)
        counts = g_fine * N * (N / BOX ** 3) * 4 / 3 * np.pi * (e_fine[1:] ** 3 - e_fine[:-1] ** 3)
        kernel = np.exp(-0.5 * ((r_fine[:, None] - centers[None]) / params.sigma) ** 2) \
            / (np.sqrt(2 * np.pi) * params.sigma)
        ref = (counts @ kernel) * np.diff(edges) * BOX ** 3 / (N * N * shells)
        assert ours.max() > 1.5                     # a real structured g(r)
        np.testing.assert_allclose(ours, ref, atol=2e-3)


def test_rdf_beyond_half_the_box_counts_every_image(lj):
    """periodic_images='all': g(r) up to 1.2 nm in the 1.827 nm box equals
    ASE's histogram of a 2 x 2 x 2 supercell (which sees every image), where
    the minimum-image RDF would miss pairs beyond half the box."""
    from ase.geometry.rdf import get_rdf
    displacement, _, _, R, P, nbrs = lj
    r_max = 1.2
    params = quantity.rdf_discretization(r_max, nbins=60)
    rdf_fn = jax.jit(lambda s, nb: quantity.rdf(displacement, params, BOX,
                                                periodic_images="all")(s, neighbor=nb))
    nearest = jax.jit(lambda s, nb: quantity.rdf(displacement, params, BOX,
                                                 periodic_images="nearest")(s))
    centers, edges = np.asarray(params.bin_centers), np.asarray(params.bin_edges)
    shells = 4 / 3 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)
    state = _state(R[0], P[0])
    ours = np.asarray(rdf_fn(state, nbrs.update(state.position)))
    n_fine = 60_000
    g_fine, r_fine = get_rdf(_ase_atoms(R[0]).repeat(2), r_max, n_fine)
    e_fine = np.linspace(0.0, r_max, n_fine + 1)
    fine_shells = 4 / 3 * np.pi * (e_fine[1:] ** 3 - e_fine[:-1] ** 3)
    kernel = np.exp(-0.5 * ((r_fine[:, None] - centers[None]) / params.sigma) ** 2) \
        / (np.sqrt(2 * np.pi) * params.sigma)
    ref = ((g_fine * fine_shells) @ kernel) * np.diff(edges) / shells
    far = centers > 1.0
    assert ref[far].mean() > 0.8                    # a liquid: g -> 1 at long range
    np.testing.assert_allclose(ours, ref, atol=3e-3)
    assert np.asarray(nearest(state, None))[far].mean() < 0.5 * ref[far].mean()


def test_rdf_same_from_dense_sparse_and_ordered_lists(lj):
    displacement, _, _, R, P, _ = lj
    params = quantity.rdf_discretization(0.8, nbins=40)
    state = _state(R[0], P[0])
    rdf_fn = jax.jit(lambda s, nb: quantity.rdf(displacement, params, BOX)(s, neighbor=nb))
    results = []
    for fmt in (partition.Dense, partition.Sparse, partition.OrderedSparse):
        nf = partition.neighbor_list(displacement, BOX, R_CUT, format=fmt)
        results.append(np.asarray(rdf_fn(state, nf.allocate(state.position))))
    np.testing.assert_allclose(results[1], results[0], atol=1e-12)
    np.testing.assert_allclose(results[2], results[0], atol=1e-12)


def _adf_numpy(R, box, r_outer, centers, sigma):
    """Brute force over all triplets j-i-k with the minimum image."""
    hist, n_triplets = np.zeros(len(centers)), 0
    for i in range(len(R)):
        d = R - R[i]
        d -= box * np.round(d / box)
        r = np.linalg.norm(d, axis=1)
        nb = np.where((r < r_outer) & (np.arange(len(R)) != i))[0]
        u = d[nb] / r[nb, None]
        cos = np.clip(u @ u.T, -1, 1)
        theta = np.arccos(cos[~np.eye(len(nb), dtype=bool)])
        hist += np.exp(-0.5 * ((theta[:, None] - centers[None]) / sigma) ** 2).sum(0)
        n_triplets += theta.size
    return hist / (np.sqrt(2 * np.pi) * sigma) / n_triplets


def test_adf_matches_brute_force(lj):
    displacement, _, _, R, P, nbrs = lj
    params = quantity.adf_discretization(r_outer=0.45, nbins=60)
    state = _state(R[1], P[1])
    ref = _adf_numpy(R[1], BOX, 0.45, np.asarray(params.bin_centers), params.sigma)
    dense = partition.neighbor_list(displacement, BOX, R_CUT, format=partition.Dense)
    adf_dense = jax.jit(lambda s, nb: quantity.adf(displacement, params, BOX)(s, neighbor=nb))
    ours = adf_dense(state, dense.allocate(state.position))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-8, atol=1e-10)
    # integrates to ~1 over [0, pi] (a density in rad^-1)
    assert float(jnp.sum(ours) * params.sigma) == pytest.approx(1.0, abs=0.02)
    nb = nbrs.update(state.position)   # Sparse
    adf_sparse = jax.jit(lambda s, nb, m: quantity.adf(displacement, params, BOX, max_neighbors=m)(
        s, neighbor=nb), static_argnums=2)
    np.testing.assert_allclose(np.asarray(adf_sparse(state, nb, 24)), ref, rtol=1e-8, atol=1e-10)
    assert np.all(np.isnan(np.asarray(adf_sparse(state, nb, 2))))   # too small: loud NaN
    with pytest.raises(ValueError, match="max_neighbors"):
        quantity.adf(displacement, params, BOX)(state, neighbor=nb)


def test_density_temperature_kinetic_energy(lj):
    _, _, _, R, P, _ = lj
    state = _state(R[0], P[0])
    ke = 0.5 * np.sum(P[0] ** 2) / MASS
    assert float(quantity.kinetic_energy()(state)) == pytest.approx(ke, rel=1e-12)
    assert float(quantity.temperature()(state)) == pytest.approx(2 * ke / (3 * N), rel=1e-12)
    assert float(quantity.density(BOX)(state)) == pytest.approx(N * MASS / BOX ** 3, rel=1e-12)
    # the box may also come with the call (state_kwargs)
    assert float(quantity.density()(state, box=BOX)) == pytest.approx(N * MASS / BOX ** 3,
                                                                      rel=1e-12)
    with pytest.raises(ValueError, match="box"):
        quantity.density()(state)
    with pytest.raises(ValueError, match="energy_fn"):
        quantity.pressure(BOX)(state, neighbor=None)
    # without a neighbor list a small system's RDF comes from all pairs: the same values
    rdf = quantity.rdf(lj[0], quantity.rdf_discretization(0.8, 10), BOX)
    np.testing.assert_allclose(np.asarray(rdf(state)),
                               np.asarray(rdf(state, neighbor=lj[5].update(R[0]))), rtol=1e-10)


@pytest.mark.parametrize("model", ["lj", "mlp"])
def test_templates_forward_perturbation(lj, model):
    """The virial of chemtrain's pair templates equals the central-difference
    derivative of the energy when box and positions are scaled by (1 + eps)
    explicitly (a new periodic space, no perturbation keyword)."""
    displacement, _, _, R, P, nbrs = lj
    if model == "lj":
        make = lambda d: lennard_jones_template(d, R_CUT)   # noqa: E731
        params = {"sigma": SIGMA, "epsilon": EPSILON}
    else:
        make = lambda d: pair_mlp_template(d, R_CUT)        # noqa: E731
        params = init_pair_mlp(jax.random.PRNGKey(3), hidden=(8,), dtype=jnp.float64)
    state = _state(R[2], P[2])
    nb = nbrs.update(state.position)   # holds every pair within R_CUT + 0.01

    @jax.jit
    def virial_pressure_and_scaled_energies(eps):
        virial = quantity.pressure(BOX, include_kinetic=False)(
            state, neighbor=nb, energy_fn=make(displacement)(params))

        def scaled(e):
            d, _ = space.periodic(BOX * (1 + e))
            return make(d)(params)(state.position * (1 + e), neighbor=nb)
        return virial, scaled(eps), scaled(-eps)

    h = 1e-5
    virial, up, down = virial_pressure_and_scaled_energies(h)
    dU = (float(up) - float(down)) / (2 * h)
    assert float(virial) == pytest.approx(-dU / (3 * BOX ** 3), rel=1e-6)
    assert abs(dU) > 1.0


def test_harmonic_bond_template():
    displacement, _ = space.periodic(2.0)
    R = jnp.asarray([[0.1, 0.1, 0.1], [1.9, 0.1, 0.1], [0.1, 0.5, 0.1]])   # 0-1 across the boundary
    template = harmonic_bond_template(displacement, [[0, 1], [0, 2]])
    energy_fn = template({"k": 100.0, "r0": 0.3})
    expected = 0.5 * 100.0 * ((0.2 - 0.3) ** 2 + (0.4 - 0.3) ** 2)
    U, dU = jax.jit(jax.value_and_grad(lambda e: energy_fn(R, perturbation=1 + e)))(0.0)
    assert float(U) == pytest.approx(expected, rel=1e-12)
    # perturbation scales both bonds: dU/d eps = sum k (r - r0) r
    assert float(dU) == pytest.approx(100.0 * (-0.1 * 0.2 + 0.1 * 0.4), rel=1e-10)
    with pytest.raises(ValueError, match="n_bonds, 2"):
        harmonic_bond_template(displacement, [0, 1])


def test_npt_snapshots_use_their_own_box(lj):
    """A frame held by an NPT state (fractional positions, box from
    box_position) gives the same pressure, RDF and density as the same frame
    in a fixed box (which the tests above check against ASE)."""
    displacement, _, energy_fn, R, P, nbrs = lj
    reference_box = 1.7 * jnp.eye(3)
    frac_disp, _ = space.periodic_general(reference_box, fractional_coordinates=True)
    frac_nf = partition.neighbor_list(frac_disp, reference_box, R_CUT, dr_threshold=0.01,
                                      format=partition.Sparse, fractional_coordinates=True)
    frac_energy = lennard_jones_template(frac_disp, R_CUT)({"sigma": SIGMA, "epsilon": EPSILON})
    npt_state = simulate.NPTNoseHooverState(
        jnp.asarray(R[0] / BOX), jnp.asarray(P[0]), jnp.zeros((N, 3)), jnp.full((N, 1), MASS),
        reference_box, jnp.log(BOX / 1.7), 0.0, 1.0, None, None)
    np.testing.assert_allclose(simulate.npt_box(npt_state), BOX * np.eye(3), rtol=1e-14)
    params = quantity.rdf_discretization(R_CUT, nbins=45)

    def values(state, nb, disp, efn, box):
        return (quantity.pressure(box)(state, neighbor=nb, energy_fn=efn),
                quantity.rdf(disp, params, box)(state, neighbor=nb),
                quantity.density(box)(state))

    nvt = jax.jit(lambda s, nb: values(s, nb, displacement, energy_fn, BOX))(
        _state(R[0], P[0]), nbrs.update(jnp.asarray(R[0])))
    nb = frac_nf.allocate(npt_state.position, box=simulate.npt_box(npt_state))
    npt = jax.jit(lambda s, nb: values(s, nb, frac_disp, frac_energy, None))(npt_state, nb)
    for a, b in zip(npt, nvt):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)


def test_a_list_shorter_than_the_quantity_range_is_refused_or_completed(lj):
    """Pairs beyond the neighbor list's cutoff never vanish from g(r) or the
    ADF without a word: a small system's RDF is computed from all pairs
    (the same values as with a long list), a larger one and the ADF are
    refused naming both numbers, whether the list comes from jax-md or from
    chemtrain.neighbors."""
    from chemtrain.neighbors import neighbor_list
    displacement, _, _, R, P, _ = lj
    state = _state(R[0], P[0])
    rdf = quantity.rdf(displacement, quantity.rdf_discretization(0.8, 40), BOX)
    # as if the system were large: at most 100 distances from all pairs
    rdf_large = quantity.rdf(displacement, quantity.rdf_discretization(0.8, 40), BOX,
                             max_all_pairs=100)
    adf = quantity.adf(displacement, quantity.adf_discretization(r_outer=0.6, nbins=20), BOX)
    full = rdf(state, neighbor=partition.neighbor_list(displacement, BOX, 0.85, format=partition.Dense)
               .allocate(state.position))
    for short in (partition.neighbor_list(displacement, BOX, 0.5, format=partition.Dense),
                  neighbor_list(displacement, BOX, 0.5, format="dense")):
        nb = short.allocate(state.position)
        np.testing.assert_allclose(jax.jit(lambda s, nb: rdf(s, neighbor=nb))(state, nb), full,
                                   rtol=1e-10, atol=1e-12)   # 128 particles: all pairs
        with pytest.raises(ValueError, match=r"RDF counts pairs up to 0\.8 nm, but the "
                                             r"neighbor list's cutoff is 0\.5 nm.*rdf_cut"):
            jax.jit(lambda s, nb: rdf_large(s, neighbor=nb))(state, nb)
        with pytest.raises(ValueError, match=r"ADF counts pairs up to 0\.6 nm.*cutoff is 0\.5 nm"
                                             r".*r_outer"):
            adf(state, neighbor=nb)
    # a jax-md list's skin guards moving particles only: what it surely holds is r_cutoff
    skinned = partition.neighbor_list(displacement, BOX, 0.75, dr_threshold=0.1,
                                      format=partition.Dense).allocate(state.position)
    with pytest.raises(ValueError, match=r"cutoff is 0\.75 nm"):
        rdf_large(state, neighbor=skinned)
    # an RDF range beyond half the box: say which images count. Two particles,
    # box 1 nm, RDF to 1 nm; 'nearest' (upstream's g(r)) needs the farthest
    # minimum image, sqrt(3)/2 nm, and a 0.5 nm list is completed from all pairs
    disp1, _ = space.periodic(1.0)
    two = _state(np.array([[0.0, 0.0, 0.0], [0.5, 0.5, 0.45]]), np.zeros((2, 3)))
    two = two.set(mass=jnp.ones((2, 1)))
    bins = quantity.rdf_discretization(1.0, 50)
    nb9 = partition.neighbor_list(disp1, 1.0, 0.9, format=partition.Dense).allocate(two.position)
    with pytest.raises(ValueError, match=r"range \(1 nm\) exceeds half the box.*periodic_images"):
        quantity.rdf(disp1, bins, 1.0)(two, neighbor=nb9)
    rdf1 = quantity.rdf(disp1, bins, 1.0, periodic_images="nearest")
    g = jax.jit(lambda s, nb: rdf1(s, neighbor=nb))(two, nb9)
    assert float(jnp.sum(g)) > 0
    nb5 = partition.neighbor_list(disp1, 1.0, 0.5, format=partition.Dense).allocate(two.position)
    np.testing.assert_allclose(rdf1(two, neighbor=nb5), g, rtol=1e-12)
    # in two dimensions the farthest image is sqrt(2)/2 nm: a 0.75 nm list suffices
    flat = simulate.NVTLangevinState(jnp.array([[0.0, 0.0], [0.5, 0.45]]), jnp.zeros((2, 2)),
                                     jnp.zeros((2, 2)), jnp.ones((2, 1)), jax.random.PRNGKey(0))
    nb = partition.neighbor_list(disp1, 1.0, 0.75, format=partition.Dense).allocate(flat.position)
    assert float(jnp.sum(jax.jit(lambda s, nb: rdf1(s, neighbor=nb))(flat, nb))) > 0

"""Per-target losses: Huber's, mace-torch's conditional Huber on forces,
energies per atom, against values computed by hand."""
import jax.numpy as jnp
import numpy as np
import pytest

from chemtrain.data.loader import VALID
from chemtrain.learn import force_matching as fm
from chemtrain.learn.losses import TargetLoss, check_losses, conditional_huber, huber


def test_huber_by_hand():
    f = huber(0.5)
    r = jnp.array([0.1, -0.5, 2.0, -3.0])
    want = [0.5 * 0.01, 0.5 * 0.25, 0.5 * (2.0 - 0.25), 0.5 * (3.0 - 0.25)]
    np.testing.assert_allclose(np.asarray(f(r)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="delta must be a finite number > 0"):
        huber(0.0)


def test_conditional_huber_shrinks_delta_for_large_reference_forces():
    f = conditional_huber(1.0, edges=(10.0, 20.0, 30.0))
    ref = jnp.array([[3.0, 4.0, 0.0],     # |F| 5: delta 1
                     [0.0, 15.0, 0.0],    # 15: 0.7
                     [25.0, 0.0, 0.0],    # 25: 0.4
                     [0.0, 0.0, -40.0]])  # 40: 0.1
    r = jnp.full((4, 3), 0.8)
    d = np.array([1.0, 0.7, 0.4, 0.1])[:, None]
    want = np.where(0.8 <= d, 0.5 * 0.64, d * (0.8 - 0.5 * d)) * np.ones((4, 3))
    np.testing.assert_allclose(np.asarray(f(r, ref)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="one factor more than edges"):
        conditional_huber(1.0, edges=(1.0,), factors=(1.0,))


def test_conditional_huber_default_edges_are_mace_torchs_in_kj_mol_nm():
    """The default edges are mace-torch's 100/200/300 eV/Angstrom in chemtrain's
    kJ/mol/nm (x964.853): an ordinary atom (0.5 and 150 eV/Angstrom here)
    keeps the threshold of its interval. Before, the numbers 100/200/300
    were taken in kJ/mol/nm: both atoms got the factor 0.1 of atoms above
    300 eV/Angstrom."""
    per = 96.48533212 / 0.1
    f = conditional_huber(2.0)
    ref = jnp.array([[0.5 * per, 0.0, 0.0], [0.0, 150.0 * per, 0.0], [0.0, 0.0, 350.0 * per]])
    r = jnp.full((3, 3), 5.0)
    d = 2.0 * np.array([1.0, 0.7, 0.1])[:, None]
    want = d * (5.0 - 0.5 * d) * np.ones((3, 3))
    np.testing.assert_allclose(np.asarray(f(r, ref)), want, rtol=1e-6)


def test_per_sample_errors_with_losses():
    batch = {"R": jnp.zeros((2, 3, 3)), "U": jnp.array([1.0, 4.0]),
             "F": jnp.zeros((2, 3, 3)), "mask": jnp.array([[1, 1, 0], [1, 1, 1]]),
             VALID: jnp.array([True, True])}
    pred = {"U": jnp.array([3.0, 1.0]), "F": jnp.ones((2, 3, 3)) * 2.0}
    losses = check_losses({"U": TargetLoss(huber(0.5), per_atom=True), "F": huber(1.0)},
                          ("U", "F"))
    out = fm.per_sample_errors(pred, batch, ("U", "F"), losses)
    # U per atom: residual 2/2 = 1 and -3/3 = -1 -> huber 0.5 (1 - 0.25) each
    np.testing.assert_allclose(np.asarray(out["U"]), [0.375, 0.375], rtol=1e-6)
    # F: every component 2 -> 1.0 * (2 - 0.5) = 1.5; mean over real atoms' components
    np.testing.assert_allclose(np.asarray(out["F"]), [1.5, 1.5], rtol=1e-6)
    plain = fm.per_sample_errors(pred, batch, ("U", "F"))
    np.testing.assert_allclose(np.asarray(plain["U"]), [4.0, 9.0])
    np.testing.assert_allclose(np.asarray(plain["F"]), [4.0, 4.0])


def test_bad_loss_specs_are_named():
    with pytest.raises(ValueError, match="'stress', which is not trained"):
        check_losses({"stress": huber(1.0)}, ("U", "F"))
    with pytest.raises(ValueError, match="per_atom applies to energies"):
        check_losses({"F": TargetLoss(huber(1.0), per_atom=True)}, ("U", "F"))
    with pytest.raises(TypeError, match=r"losses\['F'\] must be a function"):
        check_losses({"F": 1.0}, ("U", "F"))

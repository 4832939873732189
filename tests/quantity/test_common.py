"""chemtrain.quantity.common: the Gaussian-smoothed histogram (its windowed
path for uniform bins against the plain sum over all bins, computed here
with numpy) and the masses of a state."""
import types

import numpy as np

from chemtrain.quantity.common import masses, smoothed_histogram, uniform_bins


def _reference(x, use, centers, sigma):
    k = np.exp(-0.5 * ((x[:, None] - centers[None, :]) / sigma) ** 2)
    return (k * use[:, None]).sum(0) / (np.sqrt(2 * np.pi) * sigma)


def test_windowed_histogram_equals_the_full_sum():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 0.9, 300)
    use = rng.uniform(size=300) > 0.2
    uniform = np.linspace(0.0, 1.0, 101)
    assert uniform_bins(uniform) and not uniform_bins(uniform ** 2)
    for centers, sigma in ((uniform, 0.01), (uniform, 0.003), (uniform ** 2, 0.02)):
        # the window drops each sample's tail beyond 6 sigma: at most
        # exp(-18) of a kernel's peak per sample
        tails = use.sum() * np.exp(-18.0) / (np.sqrt(2 * np.pi) * sigma)
        np.testing.assert_allclose(np.asarray(smoothed_histogram(x, use, centers, sigma)),
                                   _reference(x, use, centers, sigma), rtol=1e-9, atol=tails)


def test_masses_of_every_shape():
    pos = np.zeros((3, 3))
    for mass in (2.0, np.full(3, 2.0), np.full((3, 1), 2.0)):
        np.testing.assert_array_equal(masses(types.SimpleNamespace(position=pos, mass=mass)),
                                      [2.0, 2.0, 2.0])

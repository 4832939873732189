"""The definitions shared across the package (issue 53's twins): one
checksum (chemtrain.checksum.crc) and one committee spread
(chemtrain.learn.ensemble.committee_spread), checked against values
written out by hand."""
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from chemtrain.checksum import crc
from chemtrain.learn.ensemble import committee_spread


def test_crc_is_the_crc32_of_the_values_bytes_one_after_another():
    a = np.array([[1, 2], [3, 4]], np.int32).T          # not C-ordered: its C bytes count
    want = zlib.crc32(b"key" + b"raw" + np.array([1, 3, 2, 4], np.int32).tobytes())
    assert crc("key", b"raw", a) == want
    assert crc(a, start=crc("key", b"raw")) == want     # extended piece by piece
    assert crc(np.float64(0.5)) == zlib.crc32(np.array(0.5).tobytes())
    assert crc("key") != crc("kez")


def test_committee_spread_is_the_population_std_over_members_on_host_and_traced():
    members = np.array([[1.0, 2.0], [3.0, 2.0], [5.0, 8.0]])
    want = np.array([np.sqrt(8.0 / 3.0), np.sqrt(8.0)])   # sum of squares / 3, by hand
    got = committee_spread(members)
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with jax.enable_x64(True):
        traced = jax.jit(committee_spread)(jnp.asarray(members))
    assert isinstance(traced, jax.Array)
    np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-12)

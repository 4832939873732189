"""RelativeEntropy on bad input (issue 37): an NPT simulator set up as
jax-md intends (periodic_general, fractional coordinates, the box in the
state's keyword arguments) is refused before any trajectory is sampled.
Before, the check read the snapshots of a trajectory that had none yet, and
training went on while the box changed (3.040 -> 3.077 nm)."""
import functools
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, simulate, space

from chemtrain.models.pair import harmonic_bond_template
from chemtrain.simulate import process_printouts
from chemtrain.trainers import RelativeEntropy


def test_npt_simulator_is_refused_before_sampling(tmp_path):
    box, molecules = 3.04, 4
    displacement, shift = space.periodic_general(box, fractional_coordinates=True)
    base = harmonic_bond_template(displacement, [[2 * i, 2 * i + 1] for i in range(molecules)])

    def template(p):
        return base({"k": 100 * p["b"], "r0": p["r_0"]})
    neighbor_fn = partition.neighbor_list(displacement, box, 1.0, fractional_coordinates=True,
                                          format=partition.NeighborListFormat.Sparse)
    simulator = functools.partial(simulate.npt_nose_hoover, shift_fn=shift, dt=0.002,
                                  pressure=0.06, kT=2.56)
    frames = np.random.default_rng(0).random((20, 2 * molecules, 3))   # fractional
    trainer = RelativeEntropy({"r_0": jnp.asarray(0.3), "b": jnp.asarray(1.5)},
                              optax.adam(1e-3), progress=False,
                              checkpoint_path=str(tmp_path / "ck"))
    with pytest.raises(ValueError, match=r"assumes a fixed box \(NVT\); the simulator gives NPT "
                                         r"states\. Use an NVT simulator"):
        trainer.add_statepoint(frames, template, simulator, neighbor_fn,
                               process_printouts(0.002, 0.2, 0.1, 0.02),
                               {"kT": 2.56, "mass": 15.0, "box": box}, frames[0],
                               reference_batch_size=10)
    assert not os.path.exists(tmp_path / "ck") or not os.listdir(tmp_path / "ck")


def test_kt_in_kelvin_is_warned_about(tmp_path):
    """kT = 300 (a temperature in kelvin, 36,000 K as kJ/mol) passes the
    checks of a positive number; a warning names the likely mistake."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples",
                                    "relative_entropy"))
    import cg_bond_and_lj as ex
    with pytest.warns(UserWarning, match=r"kT = 300 kJ/mol is 36,082 K.*chemtrain\.units\.kT"
                                         r"\(300\) = 2\.494"):
        ex.bond_trainer(0, kTs=(300.0,), frames=10, initialize=False, progress=False,
                        checkpoint_path=str(tmp_path / "a"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # 2.56 kJ/mol (308 K) is quiet
        ex.bond_trainer(0, frames=10, initialize=False, progress=False,
                        checkpoint_path=str(tmp_path / "b"))


def test_reference_frames_in_other_units_are_refused(tmp_path):
    """Frames in Angstrom (x10) for a model in nm: before, it trained (bonds
    folded by the minimum image)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples",
                                    "relative_entropy"))
    import cg_bond_and_lj as ex
    frames = ex.exact_bond_frames(10, 3)
    with pytest.raises(ValueError, match=r"reference frame 0 spans .* times as much\. Pass "
                                         r"reference frames in the model's units"):
        ex.bond_trainer(0, frames=10, reference_data=10.0 * frames, production=0.2,
                        progress=False, checkpoint_path=str(tmp_path / "a"))

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
from chemtrain.trainers import RelativeEntropy, RunOptions
from paths import EXAMPLES


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
                              optax.adam(1e-3), checkpoint_path=str(tmp_path / "ck"),
                              options=RunOptions(progress=False))
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
    sys.path.insert(0, os.path.join(EXAMPLES,
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
    sys.path.insert(0, os.path.join(EXAMPLES,
                                    "relative_entropy"))
    import cg_bond_and_lj as ex
    frames = ex.exact_bond_frames(10, 3)
    with pytest.raises(ValueError, match=r"reference frame 0 spans .* times as much\. Pass "
                                         r"reference frames in the model's units"):
        ex.bond_trainer(0, frames=10, reference_data=10.0 * frames, production=0.2,
                        progress=False, checkpoint_path=str(tmp_path / "a"))


def _example():
    import sys
    sys.path.insert(0, os.path.join(EXAMPLES,
                                    "relative_entropy"))
    import cg_bond_and_lj as ex
    return ex


def test_a_reference_frame_with_overlapping_particles_is_refused_by_number(tmp_path):
    """One frame of 20 with two particles 0.005 nm apart: before, its
    gradient (norm 4e22) overflowed Adam's float32 second moment and every
    later loss was 0.0 with the parameters frozen, without an error. Only
    frame 0 was checked."""
    ex = _example()
    frames = ex.exact_bond_frames(20, 3)
    frames[7, 2] = frames[7, 0] + np.array([0.005, 0.0, 0.0])   # molecule 1 onto molecule 0
    with pytest.raises(ValueError, match=r"reference frame\(s\) 7 \(.*\) have energies \(kJ/mol\) "
                                         r"far above the others .*Remove it from reference_data"):
        ex.bond_trainer(0, frames=20, reference_data=frames, production=0.2, prior=True,
                        progress=False, checkpoint_path=str(tmp_path / "a"))
    # the same frames without the overlap pass
    ex.bond_trainer(0, frames=20, reference_data=ex.exact_bond_frames(20, 3), production=0.2,
                    prior=True, initialize=False, progress=False,
                    checkpoint_path=str(tmp_path / "b"))


def test_an_update_that_overflows_the_optimizer_state_stops_training(tmp_path):
    """A finite gradient so large that Adam's float32 second moment becomes
    inf gives updates of 0 from then on: training silently stopped moving.
    Here the gradient is scaled by 1e200 before Adam (float64: its square
    overflows as 1e22 squared does in float32)."""
    from chemtrain.trainers import TrainingError
    ex = _example()
    optimizer = optax.chain(optax.scale(1e200), optax.adam(1e-3))
    trainer, _ = ex.bond_trainer(0, frames=20, production=0.2, optimizer=optimizer,
                                 progress=False, checkpoint_path=str(tmp_path / "a"))
    with pytest.raises(TrainingError, match=r"non-finite parameters or optimizer state in update "
                                            r"0 .*optimizer's moments overflow"):
        trainer.train(2)
    assert trainer.update_count == 0


def test_hdf5_reference_frames_are_fingerprinted_by_content(tmp_path):
    """Node-local copies of the reference file with the same path but other
    content changed the result silently: the fingerprint the processes
    compare was the path, the rows and the batch size only."""
    import h5py
    from chemtrain.data import HDF5ParallelDataLoader
    from chemtrain.learn import ReferenceFrames
    ex = _example()
    frames = ex.exact_bond_frames(30, 5)
    path = str(tmp_path / "ref.h5")

    def fingerprint(R):
        with h5py.File(path, "w") as f:
            f["R"] = R
        loader = HDF5ParallelDataLoader(path, keys=["R"])
        return ReferenceFrames(loader, R[0], 10, "test").fingerprint()
    same = fingerprint(frames)
    assert np.array_equal(fingerprint(frames.copy()), same)
    shifted = frames.copy()
    shifted[17, 3] += 0.01   # one coordinate of one frame
    assert not np.array_equal(fingerprint(shifted), same)

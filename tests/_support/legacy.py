"""The settings of the runs that wrote the checkpoints in ``tests/_support/files/``
(see ``tests/_support/files/make_legacy_checkpoints.py``)."""
from chemtrain.simulate import process_printouts

FM_SETUP = dict(n_frames=24, batch=4, seed=3, train_ratio=0.5, val_ratio=0.25)


def difftre_setup():
    """DifftreParallel keyword arguments on top of ``bonded_pair``: one
    state point and short trajectories (a small file)."""
    return dict(n_statepoints=1, timings=process_printouts(0.01, 3.0, 1.0, 0.2))

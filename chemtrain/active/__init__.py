"""On-the-fly active learning with a committee: run MD with the committee,
stop where it is unsure, label with any ASE calculator, retrain, go on::

    from chemtrain import active
    from ase.calculators.emt import EMT
    result = active.run("runs/active", oracle=EMT, seeds=structures,
                        labelled=seed_labels, settings=active.Settings(rounds=5))

Everything lives in one folder (see :mod:`chemtrain.active.loop`); calling
:func:`run` again on it continues where it stopped. The command line is
``chemtrain-active``.
"""
from .folder import FolderInUse
from .loop import PHASES, absurd, choose, label_one, run
from .pick import diverse, fingerprints
from .settings import Settings

__all__ = ["run", "Settings", "PHASES", "diverse", "fingerprints", "label_one", "absurd",
           "choose", "FolderInUse"]

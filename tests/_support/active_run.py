"""The small active-learning run of tests/test_active.py: its inputs, and
the run in a process of its own for the tests that kill it.

    python tests/_support/active_run.py FOLDER

runs (or continues) that run in FOLDER, in float64 with the test session's
compilation cache, with an EMT oracle that takes 0.3 s per label so that a
test can kill the process while it labels (the labels are EMT's)."""
import os
import sys
import time

SIZES = ["--num_channels", "8", "--max_L", "0", "--max_ell", "1", "--correlation", "2",
         "--r_max", "4.0", "--radial_MLP", "[16, 16]", "--batch_size", "4"]


def cu(seed: int, rattle: float = 0.05, a: float = 3.61):
    from ase.build import bulk
    atoms = bulk("Cu", "fcc", a=a, cubic=True) * (2, 2, 2)
    atoms.rattle(rattle, seed=seed)
    return atoms


def emt(atoms):
    from ase.calculators.emt import EMT
    from chemtrain.active.files import labelled_copy
    a = atoms.copy()
    a.calc = EMT()
    return labelled_copy(atoms, a.get_potential_energy(), a.get_forces())


def settings(**kw):
    from chemtrain.active import Settings
    return Settings(**{**dict(rounds=1, labels_per_round=3, ensemble_size=2, epochs_first=8,
                              epochs_per_round=3, md_steps=150, record_every=5,
                              temperatures_K=(900.0,), threshold=1.0, finetune_args=SIZES),
                       **kw})


def inputs() -> dict:
    """The run's seeds, seed labels, test and calibration sets and settings."""
    return {"seeds": [cu(0, 0.0)], "labelled": [emt(cu(k)) for k in range(1, 9)],
            "test": [emt(cu(k, 0.1)) for k in range(20, 24)],
            "calibration": [emt(cu(k, 0.08)) for k in range(30, 34)], "settings": settings()}


def slow_emt():
    from ase.calculators.emt import EMT

    class SlowEMT(EMT):
        def calculate(self, *args, **kwargs):
            time.sleep(0.3)
            return super().calculate(*args, **kwargs)
    return SlowEMT()


def main(folder: str) -> None:
    import chemtrain  # noqa: F401
    import jax
    jax.config.update("jax_enable_x64", True)   # as the test process (conftest)
    import mp
    mp.session_compile_cache()
    from chemtrain import active
    new = not os.path.exists(os.path.join(folder, "state.json"))
    active.run(folder, oracle=slow_emt, say=lambda line: print(line, flush=True),
               **(inputs() if new else {}))


if __name__ == "__main__":
    main(sys.argv[1])

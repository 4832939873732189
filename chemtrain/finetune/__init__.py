"""``chemtrain-finetune``: train or fine-tune MACE on any data set in one command::

    chemtrain-finetune --train_file data.xyz --foundation_model mace.model \\
        --trust_foundation_model --max_num_epochs 50 --results_dir runs/mine
    python -m chemtrain.finetune --help

mace-torch users will find ``mace_run_train``'s flags (see :mod:`.cli`). The
job reads extxyz (any file ASE reads; keys chosen by ``--energy_key``,
``--forces_key``, ``--stress_key``), MD22/sGDML ``.npz`` or chemtrain HDF5;
splits it (or takes ``--valid_file``/``--test_file``); starts from a
mace-torch ``.model``, a chemtrain ``.npz`` or a random MACE; sets E0s;
trains with :class:`chemtrain.trainers.ForceMatching` under any
``--parallelism`` (also under ``mpirun`` or ``jax.distributed``), with
checkpoints and ``--restart_latest``; and writes into ``--results_dir``
``metrics.jsonl`` (one line per epoch), ``parity.png``, ``curve.png`` (loss
and validation force error per epoch), ``results.json``
and the model as chemtrain ``<name>.npz`` and mace-torch ``<name>.model``.
"""
from __future__ import annotations

import logging
import sys

from . import job as J
from ..parallel.failures import is_raised_everywhere
from .data import DataError

log = logging.getLogger("chemtrain")

__all__ = ["main", "run", "DataError"]


def run(argv=None) -> dict:
    """Run one ``chemtrain-finetune`` job and return what ``results.json`` holds.

    The job is a pipeline of named stages over one
    :class:`~chemtrain.finetune.job.Job` (:data:`chemtrain.finetune.job.STAGES`):
    it reads and checks the data, builds or loads the model (the model
    family is a value, :mod:`chemtrain.finetune.family`), trains it with
    :class:`chemtrain.trainers.ForceMatching` and, on the root process,
    writes the plots, the model files and ``results.json`` into
    ``--results_dir`` (see the module docs). Errors are reported in eV and
    Angstrom, the units of mace-torch.

    Args:
      argv: the command-line arguments without the program name, as
        ``mace_run_train`` takes them (see :mod:`chemtrain.finetune.cli`);
        None: ``sys.argv[1:]``.

    Returns:
      A dict with ``before`` and ``after`` (the test errors of the starting
      and the trained model, ``{'energy_eV_per_atom' | 'force_eV_per_A' |
      'stress_eV_per_A3': {'MAE': ..., 'RMSE': ...}}``, in eV/atom,
      eV/Angstrom and eV/Angstrom^3), ``epoch`` (epochs trained in all),
      ``test_set`` (``'testing'``, or ``'validation'`` when there is no test
      set), ``n_test``, ``test_rows`` (the rows of ``--train_file`` tested
      on; None when the test set is ``--test_file``, empty when it is
      ``--valid_file``), ``parallelism`` (the strategy's name), ``n_shards``,
      ``train_file``, ``model`` (``'MACE'`` or ``'NequIP'``) and ``config``
      (the model's configuration as a dict). On
      the root process also the paths ``model_npz``, ``model_torch`` (a
      MACE's mace-torch file) or ``model_sevennet`` (a NequIP fine-tuned from
      a SevenNet checkpoint, as one; neither with ``--no_torch_export``) and
      ``curve_plot`` (when a learning curve was drawn); a committee's
      ``members_npz`` and ``members_torch`` or ``members_sevennet``.
      ``results.json`` records these files relative to ``--results_dir``.

    Raises:
      DataError: for bad flags or data (a ``--results_dir`` that cannot be
        written or holds another run, a missing checkpoint for
        ``--restart_latest`` or a run it does not continue, outliers,
        no edges within r_max, no test or validation set, ...), before
        anything is written.
      SystemExit: from the argument parser, for unknown or invalid flags
        (code 2) and for ``--help`` (code 0).
    """
    job = J.configure(argv)
    for stage in J.STAGES:
        stage(job)
    return job.results


def main(argv=None) -> int:
    """Console entry point of ``chemtrain-finetune``: :func:`run` with logging to stdout.

    Errors in the flags or the data (:class:`DataError`) end the job with
    their message on stderr (``chemtrain-finetune: error: ...``) and exit
    code 2; nothing has been written then. An error raised on every process
    is printed once, by rank 0. Under an MPI launcher with several ranks an
    error on one rank only ends every rank (``MPI_Abort`` with code 2): the
    others may be waiting for it in a collective. Other exceptions
    propagate.

    Args:
      argv: the command-line arguments without the program name; None:
        ``sys.argv[1:]``.

    Returns:
      The exit code, 0 when the job finished and 2 after a :class:`DataError`.

    Raises:
      SystemExit: from the argument parser, for unknown or invalid flags
        (code 2) and for ``--help`` (code 0).
    """
    # chemtrain's lines at INFO; other libraries' INFO (jax's, matplotlib's
    # "generated new fontManager" on a fresh machine) stays out of the log
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("chemtrain").setLevel(logging.INFO)
    try:
        run(argv)
    except DataError as e:
        everywhere = is_raised_everywhere(e)
        if not everywhere or _rank() == 0:  # an error of every rank is printed once
            print(f"chemtrain-finetune: error: {e}", file=sys.stderr, flush=True)
        if not everywhere:
            _end_every_rank(2)
        return 2
    return 0


def _rank() -> int:
    from ..parallel import mpi_world_size
    if mpi_world_size() > 1:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank()
    import jax
    return jax.process_index()


def _end_every_rank(code: int) -> None:
    """Abort the whole MPI job when this process is one of several ranks."""
    from ..parallel import mpi_world_size
    if mpi_world_size() > 1:
        from mpi4py import MPI
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(code)

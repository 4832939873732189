"""What every trainer shares about a run, as one value: where it writes
(checkpoints, metrics, plot), what it shows (progress, log lines), its name,
the replicas' consistency check and a callback after each update.

A trainer takes it as ``options=RunOptions(...)``. Upstream chemtrain's own
keywords keep working where upstream has them (``checkpoint_path`` on every
trainer, ``log_file`` on :class:`~chemtrain.trainers.ForceMatching`); giving
one both ways is refused, as is a field the trainer does not use.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What a trainer writes, shows and calls while it trains.

    Attributes:
      checkpoint_path: folder of checkpoints and error states (None: the
        trainer's default, ``"checkpoints"``).
      log_file: JSON-lines metrics file, one line per epoch (None: none).
      plot_file: where ``train`` writes its plot at its end (reweighting and
        fused training; None: none).
      plot_x: ``{target name: x values}`` of array observables' plots
        (reweighting).
      progress: tqdm bars on the root process when it writes to a terminal.
      consistency_check_every: every this many steps or updates, compare
        checksums of the state across processes and raise naming the first
        leaf that differs (None: never).
      name: the run's name, in ``<name>_error_state.npz`` (reweighting;
        None: the trainer's, e.g. ``"difftre"``).
      on_update: ``fn(record)`` called after each applied update
        (reweighting).
      epoch_line: ``record -> str``, the text of each epoch's log line after
        ``"epoch k: "`` (force matching; None:
        :func:`chemtrain.trainers.force_matching.epoch_line`).
    """

    checkpoint_path: str | os.PathLike | None = None
    log_file: str | os.PathLike | None = None
    plot_file: str | os.PathLike | None = None
    plot_x: Mapping | None = None
    progress: bool = True
    consistency_check_every: int | None = None
    name: str | None = None
    on_update: Callable | None = None
    epoch_line: Callable | None = None

    def __post_init__(self):
        for field, of in (("on_update", "one record (a dict)"), ("epoch_line", "record -> str")):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"RunOptions: {field} must be a function of {of} or None, got "
                                f"{type(value).__name__}.")
        every = self.consistency_check_every
        if every is not None and (isinstance(every, bool) or not isinstance(
                every, (int, np.integer)) or every < 1):
            raise ValueError(f"RunOptions: consistency_check_every must be a whole number >= 1 "
                             f"or None (never), got {every!r}.")


FIELDS = tuple(f.name for f in dataclasses.fields(RunOptions))
DEFAULTS = RunOptions()


def run_options(options: RunOptions | None, trainer: str, uses: tuple[str, ...],
                **upstream) -> RunOptions:
    """``options`` (None: the defaults) with the upstream-named keywords
    ``upstream`` (``{field: value or None}``) filled in, for a trainer named
    ``trainer`` that reads the fields ``uses``. Refuses a value that is not a
    :class:`RunOptions`, a field given both ways and a field set that this
    trainer would ignore."""
    if options is None:
        options = DEFAULTS
    if not isinstance(options, RunOptions):
        raise TypeError(f"{trainer}: options must be a chemtrain.trainers.RunOptions(...) or "
                        f"None, got {type(options).__name__}.")
    ignored = [f for f in FIELDS if f not in uses
               and getattr(options, f) != getattr(DEFAULTS, f)]
    if ignored:
        raise ValueError(f"{trainer} does not use RunOptions field(s) {ignored}: it reads only "
                         f"{[f for f in FIELDS if f in uses]}. Remove them.")
    for field, value in upstream.items():
        if value is None:
            continue
        if getattr(options, field) is not None:
            raise ValueError(f"{trainer}: {field} given twice, as the keyword {field}= and in "
                             f"options=RunOptions({field}=...). Give it once.")
        options = dataclasses.replace(options, **{field: value})
    return options


def split_options(kwargs: Mapping, keep: tuple[str, ...] = ("checkpoint_path",)) -> dict:
    """``kwargs`` with the :class:`RunOptions` fields it names moved into
    ``kwargs["options"]`` (merged into a RunOptions already there), but those
    in ``keep``: upstream keywords the trainer takes itself. For helper
    functions that take a trainer's keywords and the run's options side by
    side, e.g. ``make_trainer(seed, progress=False, sim_batch_size=-1)``."""
    kwargs = dict(kwargs)
    moved = {k: kwargs.pop(k) for k in list(kwargs) if k in FIELDS and k not in keep}
    if moved:
        kwargs["options"] = dataclasses.replace(kwargs.get("options") or DEFAULTS, **moved)
    return kwargs

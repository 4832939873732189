"""What a trainer shows and writes while it trains, from the root process:
tqdm bars (on a terminal, root only), a log line per epoch and
one JSON line per epoch in the metrics file (``log_file``), plus the checks
of the arguments that steer them (epochs, the metrics file).

Every line of the metrics file carries the run's id, and a run refuses a
file that holds lines of another run (two runs writing one file would
interleave their epochs), unless it continues that run (``restore``).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Mapping

import numpy as np
from ..parallel.failures import on_root
from ..progress import progress_bar

log = logging.getLogger("chemtrain")


def check_log_file(log_file) -> None:
    """Refuse a metrics-file path that cannot be a file (a folder), at
    construction rather than at the end of the first epoch."""
    if log_file is None:
        return
    if not isinstance(log_file, (str, os.PathLike)):
        raise TypeError(f"log_file must be a file path or None, got {type(log_file).__name__}.")
    if os.path.isdir(log_file):
        raise ValueError(f"log_file={os.fspath(log_file)!r} is a folder; give the path of a file "
                         f"(e.g. {os.path.join(os.fspath(log_file), 'metrics.jsonl')!r}).")


def check_epochs(max_epochs, checkpoint_freq=None) -> None:
    """``max_epochs``: a whole number >= 0; ``checkpoint_freq``: None or a
    whole number >= 1."""
    def whole(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    if not (whole(max_epochs) and max_epochs >= 0):
        raise TypeError(f"max_epochs must be a whole number >= 0 (the number of epochs to "
                        f"train), got {max_epochs!r}.")
    if checkpoint_freq is not None and not (whole(checkpoint_freq) and checkpoint_freq >= 1):
        raise TypeError(f"checkpoint_freq must be None or a whole number >= 1 (checkpoint every "
                        f"so many epochs), got {checkpoint_freq!r}.")


class Reporter:
    """Epoch reports of the root process: a log line, tqdm bars and one JSON
    line per epoch in ``log_file`` (for plotting)."""

    def __init__(self, strategy, log_file: str | None = None, progress: bool = True):
        check_log_file(log_file)
        self.strategy = strategy
        self.log_file = None if log_file is None else os.fspath(log_file)
        self.show = bool(progress) and strategy.is_root
        self.run_id = None

    def epochs(self, start: int, n: int):
        """Iterable over epoch numbers with the outer progress bar."""
        return progress_bar(range(start, start + n), desc="epochs", disable=not self.show,
                            position=0)

    def bar(self, total: int, desc: str):
        """An inner progress bar (steps of an epoch, state points, ...)."""
        return progress_bar(total=total, desc=desc, leave=False, disable=not self.show,
                            position=1)

    def claim(self, run_id: str, epoch: int = 0) -> None:
        """Write this run's lines as ``run_id``, from epoch ``epoch`` on;
        refuse (on every process) a metrics file holding lines of another
        run. This run's lines of epoch ``epoch`` or later (written after the
        checkpoint a resumed run continues from, e.g. by a run killed before
        its next checkpoint) are removed: the epochs are trained again."""
        self.run_id = run_id
        if not self.log_file:
            return

        def check():
            if not os.path.exists(self.log_file):
                return
            keep, number = [], 0
            with open(self.log_file) as f:
                for number, line in enumerate(f, 1):
                    try:
                        record = json.loads(line)
                        other = record.get("run_id")
                    except (ValueError, AttributeError):
                        record, other = None, None
                    if other != run_id:
                        raise ValueError(
                            f"The metrics file {self.log_file!r} already holds lines of another "
                            f"run (line {number}: run {other}); this run would interleave its "
                            f"epochs with them. Pass another log_file, move the file away, or "
                            f"continue that run with trainer.restore(<its checkpoint>).")
                    later = record.get("epoch")
                    if not (isinstance(later, int) and later >= epoch):
                        keep.append(line)
            if len(keep) < number:
                log.warning("%s: removed %d line(s) of epoch %d and later, written after the "
                            "checkpoint this run continues from.", self.log_file,
                            number - len(keep), epoch)
                with open(self.log_file + ".tmp", "w") as f:
                    f.writelines(keep)
                os.replace(self.log_file + ".tmp", self.log_file)
        on_root(self.strategy, check, only_root=True)

    def report(self, record: Mapping, text: str, epochs_bar=None, **postfix) -> None:
        """Log ``text``, show ``postfix`` on the epoch bar and append ``record``
        (with the run's id) to the metrics file (root only)."""
        if not self.strategy.is_root:
            return
        log.info(text)
        if epochs_bar is not None and postfix and hasattr(epochs_bar, "set_postfix"):
            epochs_bar.set_postfix(**postfix)
        if self.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
            with open(self.log_file, "a") as f:
                f.write(json.dumps(dict(record, run_id=self.run_id)) + "\n")


def close_epoch(strategy, reporter, record: dict, text: str, epochs_bar, started: float,
                **postfix) -> dict:
    """End an epoch: the slowest process's time into ``record``, then the
    report (log line, bar, metrics file). Returns ``record``; the trainer
    adds it to its state's history and checkpoints."""
    record["time_s"] = strategy.host_max(time.perf_counter() - started)
    reporter.report(record, f"{text} ({record['time_s']:.2f} s)", epochs_bar, **postfix)
    return record

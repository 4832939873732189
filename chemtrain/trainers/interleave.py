"""``InterleaveTrainers`` (upstream chemtrain's name and call pattern): one
parameter set trained in turns by several trainers, e.g. force matching on
reference forces and DiffTRe or relative entropy on ensemble data (fused
data training).

    fused = InterleaveTrainers(checkpoint_base_path="runs/fused")
    fused.add_trainer(fm_trainer, num_updates=1, name="FM")
    fused.add_trainer(difftre_trainer, num_updates=1, name="DiffTRe")
    fused.train(max_epochs)

Each fused epoch gives every trainer its turn in the order added: it
receives the current parameters (``trainer.params = ...``, checked and sent
from the root on every process), trains ``num_updates`` of its own epochs
and hands its parameters on. Each trainer keeps its own optimizer state,
history and (DiffTRe) trajectories. Nothing here knows how a trainer is
parallelised: under MPI every rank runs every turn, and a failure in any
trainer ends every rank as it does alone.

A checkpoint of epoch k is a folder ``epoch_0000k`` holding each trainer's
own checkpoint (``<name>.npz``: parameters, optimizer state, histories,
trajectory states) and, written last, ``fused.npz`` (the fused epoch, the
turn order and the fused history): plain data throughout, and a folder
without ``fused.npz`` is an incomplete checkpoint that :meth:`restore`
refuses. Saving into an existing folder first removes its ``fused.npz``, so
a write cut short leaves an incomplete folder, not a mixed one; ``fused.npz``
records each trainer's run id and epoch, which :meth:`restore` compares with
the trainer files. A folder of another run is never written over, and
training on from an earlier epoch refuses a folder that holds later ones
(as a single trainer does).
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..checkpoint import CheckpointError, why_not_writable
from ..parallel import on_root
from .report import Reporter, check_epochs
from .checkpoints import CheckpointStore, read_meta
from .epochs import run_epochs
from .options import RunOptions, run_options
from .protocol import Trainer, missing_members
from .services import collective
from .state import check_like

MARKER = "fused.npz"


class InterleaveTrainers:
    """Trainers that share one parameter set, trained in turns.

    Args:
      checkpoint_base_path: folder of the fused epoch checkpoints
        (upstream's keyword; or ``options.checkpoint_path``; default
        ``"checkpoints/fused"``).
      options: a :class:`~chemtrain.trainers.RunOptions`: ``log_file``, a
        JSON-lines file with one line per trainer part per fused epoch
        (``epoch``, ``trainer``, its ``loss`` and ``val_loss`` if any, its
        own epoch count, the time of its turn); ``plot_file``, where
        :meth:`train` writes the plot of every trainer's loss per fused
        epoch at its end; ``progress``, the fused epochs' progress bar (each
        trainer shows its own).
    """

    OPTIONS = ("checkpoint_path", "log_file", "plot_file", "progress")

    def __init__(self, checkpoint_base_path: str | None = None,
                 options: RunOptions | None = None):
        options = run_options(options, "InterleaveTrainers", self.OPTIONS,
                              checkpoint_path=checkpoint_base_path)
        self.folder = os.fspath(options.checkpoint_path or "checkpoints/fused")
        self.log_file, self.plot_file, self.progress = (options.log_file, options.plot_file,
                                                        options.progress)
        self.parts: list[tuple[str, Any, int]] = []   # (name, trainer, num_updates)
        self.epoch = 0
        self.history: list[dict] = []   # one record per trainer part per fused epoch
        self.store = self.reporter = None

    # -- building -----------------------------------------------------------
    def add_trainer(self, trainer, num_updates: int = 1, name: str | None = None) -> None:
        """Add a trainer; it trains ``num_updates`` of its epochs per turn.
        Its parameters must have the structure, shapes and dtypes of the
        first trainer's (they are replaced by the shared ones at its first
        turn)."""
        if not isinstance(trainer, Trainer):
            raise TypeError(f"add_trainer needs a chemtrain trainer (ForceMatching, "
                            f"Difftre, DifftreParallel, RelativeEntropy: the "
                            f"chemtrain.trainers.protocol.Trainer protocol); "
                            f"{type(trainer).__name__} has no {missing_members(trainer)[0]!r}.")
        if isinstance(num_updates, bool) or not isinstance(num_updates, (int, np.integer)) \
                or num_updates < 1:
            raise ValueError(f"num_updates must be a positive whole number (the trainer's epochs "
                             f"per turn), got {num_updates!r}.")
        name = f"trainer{len(self.parts)}" if name is None else str(name)
        if name in [n for n, _, _ in self.parts] or not name or "/" in name or name == "fused":
            raise ValueError(f"Trainer names must be unique, non-empty, without '/' and not "
                             f"'fused'; got {name!r} (have {[n for n, _, _ in self.parts]}).")
        if self.parts:
            first_name, first, _ = self.parts[0]
            if trainer.strategy.process_count != first.strategy.process_count:
                raise ValueError(f"Trainer {name!r} runs on {trainer.strategy.process_count} "
                                 f"process(es), {first_name!r} on "
                                 f"{first.strategy.process_count}: interleaved trainers must run "
                                 f"on the same ranks.")
            check_like(first.params, trainer.params, f"trainer {first_name!r}'s parameters",
                       f"trainer {name!r}'s parameters (interleaved trainers share one set)")
        else:
            self.store = CheckpointStore(trainer.strategy, self.folder, "InterleaveTrainers",
                                         replicated=(), marker=MARKER)
            self.reporter = Reporter(trainer.strategy, self.log_file, self.progress)
        self.parts.append((name, trainer, int(num_updates)))

    @property
    def strategy(self):
        if not self.parts:
            raise RuntimeError("No trainers yet: add_trainer(trainer, num_updates, name) first.")
        return self.parts[0][1].strategy

    @property
    def params(self):
        """The shared parameters: those of the trainer that trained last (the
        last one added, after a completed fused epoch; the first one's before
        any training)."""
        if not self.parts:
            raise RuntimeError("No trainers yet: add_trainer() first.")
        return (self.parts[-1] if self.epoch else self.parts[0])[1].params

    # -- training -----------------------------------------------------------
    @collective
    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more fused epochs; checkpoint every
        ``checkpoint_freq`` of them; write the plot at the end if
        ``plot_file`` was given."""
        if not self.parts:
            raise RuntimeError("No trainers yet: add_trainer() first.")
        check_epochs(max_epochs, checkpoint_freq)
        self._check_same_turns()
        on_root(self.strategy, lambda: self._check_outputs(checkpoint_freq), only_root=True)
        run_epochs(self, max_epochs, checkpoint_freq, self._epoch, lambda: self.save_checkpoint(
            os.path.join(self.folder, f"epoch_{self.epoch:05d}")))
        if self.plot_file:
            self.plot(self.plot_file)

    def _epoch(self, epoch: int, epochs_bar) -> None:
        """One fused epoch: each trainer's turn from the parameters the one
        before handed on, one report line per turn."""
        params = self.params
        handed_by = self.parts[-1][0] if self.epoch or epoch else None
        for name, trainer, n in self.parts:
            started = time.perf_counter()
            try:
                trainer.params = params
                trainer.train(n)
            except Exception as e:   # say whose parameters the failing turn started from
                e.add_note(_turn_note(epoch, name, handed_by))
                raise
            params, handed_by = trainer.params, name
            last = trainer.history[-1]
            record = {"epoch": epoch, "trainer": name, "trainer_epoch": trainer.epoch,
                      "loss": last.get("loss", last.get("train_loss"))}
            if "val_loss" in last:
                record["val_loss"] = last["val_loss"]
            record["time_s"] = trainer.strategy.host_max(time.perf_counter() - started)
            self.reporter.report(record, f"fused epoch {epoch}, {name}: loss "
                                         f"{record['loss']:.5g} ({record['time_s']:.1f} s)")
            self.history.append(record)
        self.epoch = epoch + 1

    def _check_outputs(self, checkpoint_freq) -> None:
        """The checkpoint folder and the plot file must be writable: found
        before the first epoch, not after it."""
        targets = [("plot_file", self.plot_file, False, False)] if self.plot_file else []
        if checkpoint_freq:
            targets.append(("checkpoint_base_path", self.folder, True, True))
        for what, path, folder, parents in targets:
            problem = why_not_writable(path, folder, parents)
            if problem:
                raise ValueError(f"InterleaveTrainers' {what} {path!r} {problem}; pass another "
                                 f"{what}. Nothing was trained.")

    def _check_same_turns(self) -> None:
        """Every process must have the same trainers, names, num_updates and
        order: otherwise their turns would wait on each other for ever."""
        self.strategy.check_same([[n, type(t).__name__, k] for n, t, k in self.parts],
                                 "the InterleaveTrainers turns ([name, trainer, num_updates] "
                                 "in the order added)")

    # -- files ----------------------------------------------------------------
    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write the folder ``path``: every trainer's checkpoint, then the
        fused state (atomically, root process). A folder of another run is
        refused; this run's is first marked incomplete (its ``fused.npz``
        removed), so an interrupted write is never restored."""
        self._check_same_turns()
        marker = os.path.join(path, MARKER)

        def make_folder():
            if os.path.exists(path) and not os.path.isdir(path):
                raise CheckpointError(f"{path!r} is a file; an InterleaveTrainers checkpoint is "
                                      f"a folder. Pass another path.")
            self.store.check_not_foreign(marker)
            for name, trainer, _ in self.parts:
                trainer.store.check_not_foreign(os.path.join(path, f"{name}.npz"))
            os.makedirs(path, exist_ok=True)
            if os.path.exists(marker):
                os.remove(marker)
        on_root(self.strategy, make_folder, only_root=True)
        for name, trainer, _ in self.parts:
            trainer.save_checkpoint(os.path.join(path, f"{name}.npz"))
        self.store.save(marker, {}, self._meta())

    def _meta(self) -> dict:
        parts = {n: {"run_id": t.store.run_id, "epoch": int(t.epoch)} for n, t, _ in self.parts}
        return {"epoch": self.epoch, "trainers": [[n, k] for n, _, k in self.parts],
                "parts": parts, "history": self.history}

    @collective
    def restore(self, path: str) -> None:
        """Continue from a checkpoint folder written by :meth:`save_checkpoint`
        (the same trainers, names and ``num_updates``, in the same order)."""
        marker = os.path.join(path, MARKER)
        exists = on_root(self.strategy, lambda: os.path.exists(marker), share=True, only_root=True)
        if not exists:
            raise CheckpointError(f"{path!r} is not a complete InterleaveTrainers checkpoint: "
                                  f"{MARKER} is missing (it is written last, after every "
                                  f"trainer's file). Restore an earlier epoch's folder.")
        want = self._meta()["trainers"]

        def check(meta):
            if meta.get("trainers") != want:
                raise CheckpointError(f"{marker!r} was written for the trainers "
                                      f"{meta.get('trainers')} ([name, num_updates] in turn "
                                      f"order); this run has {want}.")
        meta, _ = self.store.load(marker, {}, check)

        def check_parts():   # every trainer file is the one the marker was written with
            for name, want in (meta.get("parts") or {}).items():
                file = os.path.join(path, f"{name}.npz")
                got = read_meta(file)
                if got is None or got.get("run_id") != want["run_id"] \
                        or int(got.get("epoch", -1)) != want["epoch"]:
                    found = ("missing" if got is None else
                             f"run {got.get('run_id')}, epoch {got.get('epoch')}")
                    raise CheckpointError(
                        f"{file!r} is not the file {marker!r} was written with (want run "
                        f"{want['run_id']}, epoch {want['epoch']}; found {found}): the folder "
                        f"mixes checkpoints of different runs or saves. Restore another "
                        f"epoch's folder.")
        on_root(self.strategy, check_parts, only_root=True)
        saved = [_snapshot(trainer) for _, trainer, _ in self.parts]
        try:
            for name, trainer, _ in self.parts:
                trainer.restore(os.path.join(path, f"{name}.npz"))
        except BaseException:   # all or nothing: no set of trainers half restored
            for (_, trainer, _), snapshot in zip(self.parts, saved):
                _roll_back(trainer, snapshot)
            raise
        self.epoch, self.history = int(meta["epoch"]), list(meta["history"])

    @collective
    def plot(self, path: str) -> None:
        """Each trainer's loss per fused epoch, one panel per trainer."""
        on_root(self.strategy, lambda: plot_history(self.history, [n for n, _, _ in self.parts],
                                                    path), only_root=True)


def _turn_note(epoch: int, name: str, handed_by: str | None) -> str:
    start = (f"the parameters {handed_by!r}'s turn handed on" if handed_by and handed_by != name
             else "its own parameters" if handed_by else "the initial parameters")
    return (f"(InterleaveTrainers: this failed in {name!r}'s turn of fused epoch {epoch}, which "
            f"started from {start}.)")


def _snapshot(trainer) -> tuple:
    """What a trainer's ``restore`` may change: its attributes, its
    checkpoint store's (the adopted run id) and its trajectory states."""
    trajs = getattr(trainer, "trajstates", None)   # reweighting trainers only
    return (dict(vars(trainer)), dict(vars(trainer.store)),
            dict(trajs) if isinstance(trajs, dict) else None)


def _roll_back(trainer, snapshot) -> None:
    attrs, store_attrs, trajs = snapshot
    vars(trainer).clear()
    vars(trainer).update(attrs)
    vars(trainer.store).clear()
    vars(trainer.store).update(store_attrs)
    if trajs is not None:
        trainer.trajstates.clear()
        trainer.trajstates.update(trajs)


def plot_history(history, names, path: str) -> None:
    from matplotlib.figure import Figure
    if not history:
        raise RuntimeError("Nothing to plot yet: train first.")
    fig = Figure(figsize=(4.0 * len(names), 3.0), constrained_layout=True)
    axes = np.atleast_1d(fig.subplots(1, len(names)))
    for ax, name in zip(axes, names):
        rows = [r for r in history if r["trainer"] == name]
        ax.plot([r["epoch"] for r in rows], [r["loss"] for r in rows], "o-", label="loss")
        if any("val_loss" in r for r in rows):
            ax.plot([r["epoch"] for r in rows], [r.get("val_loss", np.nan) for r in rows], "s--",
                    label="validation")
            ax.legend(fontsize=7)
        ax.set_title(name)
        ax.set_xlabel("fused epoch")
        ax.set_ylabel("loss")
    fig.savefig(path, dpi=110)

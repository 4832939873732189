"""Checkpoints with the run's metadata (:class:`CheckpointStore`): plain-data
files written atomically by the root process, the run's folder claimed by
its id so two runs never mix their files, epoch checkpoints, error states
and restores checked against the trainer's settings. Every method is
collective: call it on every process in the same order."""
from __future__ import annotations

import glob
import json
import logging
import os
import uuid
from typing import Callable, Mapping, NoReturn

import jax
import numpy as np

from .. import checkpoint as ckpt
from ..parallel.failures import on_root, raised_everywhere
from ..checkpoint import check_kind  # noqa: F401  (the trainers read it from here too)
from .errors import TrainingError
from .state import TrainerState

log = logging.getLogger("chemtrain")

# the layout of a trainer state in a checkpoint's header: 1 was written by
# trainers that copied attributes by name, 2 by TrainerState; both hold the
# same fields
STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)


class CheckpointStore:
    """Checkpoints and error states of one run, as plain data.

    Only the root reads and writes; every process learns the outcome. Each
    file records the trainer, the run's id, the number of shards and of
    processes. A run refuses to write epoch checkpoints into a folder that
    holds another run's, unless it was restored from one of them.

    Args:
      strategy: the run's parallel strategy.
      folder: where epoch checkpoints and error states go.
      trainer: the trainer's name, stored in and checked on every file.
      marker: for trainers whose epoch checkpoints are folders
        ``epoch_NNNNN/`` (``InterleaveTrainers``), the file written last in
        each, whose run id is the folder's; None for ``epoch_NNNNN.npz``.
    """

    def __init__(self, strategy, folder: str, trainer: str, replicated=("params", "opt_state"),
                 marker: str | None = None):
        self.strategy = strategy
        self.folder = folder
        self.trainer = trainer
        self.marker = marker
        self.replicated = tuple(replicated)
        self.run_id = strategy.bcast_object(uuid.uuid4().hex if strategy.is_root else None)
        self._folder_checked = False

    def host(self, state: TrainerState) -> tuple[dict, dict]:
        """(trees, meta) of ``state`` (a :class:`~.state.TrainerState`): host
        numpy copies of its array fields and its plain fields, the two parts
        of a checkpoint."""
        trees, plain = state.split()
        return ({name: self.to_host(name, tree) for name, tree in trees.items()},
                dict(plain, state_version=STATE_VERSION))

    def to_host(self, name: str, tree):
        """Host numpy copy of the state's array field ``name``."""
        if name in self.replicated:
            return self.strategy.to_host(tree)
        return jax.tree.map(np.asarray, tree)

    def place(self, name: str, tree):
        """The host pytree ``tree`` as the state's array field ``name``:
        replicated on the devices, or (fields the trainer does not place)
        as uncommitted JAX arrays."""
        if name in self.replicated:
            return self.strategy.replicate(tree)
        import jax.numpy as jnp
        return jax.tree.map(jnp.asarray, tree)

    def restore(self, path: str, state: TrainerState,
                settings: Mapping) -> tuple[TrainerState, dict]:
        """Read ``path`` (see :meth:`load`) as a state of ``state``'s class
        and shape, its arrays placed as :meth:`place` does. The checkpoint
        must have been written with the same ``settings`` (``{name: this
        run's value}``: the global batch, ...; not the number of devices or
        ranks, which a resume may change); a setting the
        file does not record (written before it was) is not compared, with a
        warning. Returns (new state, metadata)."""
        def check(meta):
            unrecorded = [k for k in settings if k not in meta]
            if unrecorded:
                log.warning("%s does not record %s (written by an older chemtrain): not "
                            "compared with this run's.", path, ", ".join(unrecorded))
            ours = {k: v for k, v in settings.items() if k in meta}
            theirs = {k: meta[k] for k in ours}
            if theirs != ours:
                text = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
                raise ckpt.CheckpointError(
                    f"{path!r} was written by a run with {text(theirs)}; this run has "
                    f"{text(ours)}. Resume with the checkpoint's settings ({text(theirs)}); "
                    f"the number of devices or MPI ranks may differ.")
            version = meta.get("state_version", 1)
            if version not in READABLE_STATE_VERSIONS:
                raise ckpt.CheckpointError(
                    f"{path!r} holds a trainer state of version {version}; this chemtrain reads "
                    f"versions {READABLE_STATE_VERSIONS}. Use the chemtrain that wrote it.")
        own = self.host(state)[0]
        meta, trees = self.load(path, own, check)
        placed = {name: self.place(name, trees[name]) for name in own}
        # version 1 (attribute-by-attribute trainers) stored the same fields;
        # fields added or renamed since (the state's ADDED, RENAMED) are
        # filled in by join
        cls = type(state)
        known = {*cls.plain_fields(), *(old for old, _ in cls.RENAMED.values())}
        restored = cls.join(placed, {k: meta[k] for k in known if k in meta})
        return restored, meta

    def _meta(self, meta: Mapping, kind: str) -> dict:
        return dict(meta, kind=kind, trainer=self.trainer, run_id=self.run_id,
                    n_shards=self.strategy.n_shards, process_count=self.strategy.process_count)

    def save(self, path: str, trees: Mapping, meta: Mapping, kind: str = "checkpoint") -> None:
        """Write ``trees`` (host numpy pytrees) and ``meta`` (JSON-able) to
        ``path`` atomically on the root; raise ``CheckpointError`` on every
        process if that failed."""
        full = self._meta(meta, kind)

        def write():
            if kind == "checkpoint":
                self.check_not_foreign(path)
            try:
                ckpt.save(path, trees, full)
            except OSError as e:
                raise ckpt.CheckpointError(f"Writing the {kind} {path!r} failed on the root "
                                           f"process: {type(e).__name__}: {e}") from e
            log.info("Saved %s to %s (epoch %s)", kind, path, meta.get("epoch"))

        on_root(self.strategy, write, only_root=True)

    def check_not_foreign(self, path: str) -> None:
        """Refuse (on the calling process) to replace ``path`` when it holds a
        checkpoint of another run."""
        if not os.path.exists(path):
            return
        run = read_run_id(path)
        if run is not None and run != self.run_id:
            raise ckpt.CheckpointError(
                f"{path!r} holds a checkpoint of another run (run {run}); writing there would "
                f"replace it. Save to another path, move that file away, or continue that run "
                f"with trainer.restore({path!r}).")

    def _epoch_entries(self) -> list[tuple[str, str | None]]:
        """(name, run id) of each epoch checkpoint in the folder; a folder
        checkpoint without its marker (an incomplete one) has run id None."""
        if self.marker is None:
            return [(path, read_run_id(path))
                    for path in sorted(glob.glob(os.path.join(self.folder, "epoch_*.npz")))]
        out = []
        for path in sorted(glob.glob(os.path.join(self.folder, "epoch_*"))):
            if os.path.isdir(path) and os.listdir(path):
                marker = os.path.join(path, self.marker)
                out.append((path, read_run_id(marker) if os.path.exists(marker) else None))
        return out

    def epoch_path(self, epoch: int) -> str:
        return os.path.join(self.folder, f"epoch_{epoch:05d}.npz")

    def check_folder(self, epoch: int = 0) -> None:
        """Refuse to go on if ``folder`` holds epoch checkpoints of another
        run, or of this run beyond ``epoch`` (restored from an earlier
        epoch): they would be overwritten one by one. The folder is claimed
        for this run atomically (:func:`claim_folder`), so two runs started
        at once cannot both pass."""
        def check():
            owner = claim_folder(self.folder, self.run_id)
            foreign, later = {}, []
            for path, run in self._epoch_entries():
                if run != self.run_id:
                    foreign.setdefault(run, []).append(os.path.basename(path))
                elif _epoch_of(path) > epoch:
                    later.append(os.path.basename(path))
            if owner != self.run_id:
                foreign.setdefault(owner, []).append(OWNER_FILE)
            if foreign:
                runs = "; ".join(f"{'run ' + r if r else 'unreadable or incomplete'}: "
                                 f"{', '.join(f[:3])}{' ...' if len(f) > 3 else ''}"
                                 for r, f in foreign.items())
                raise ckpt.CheckpointError(
                    f"The checkpoint folder {self.folder!r} already holds checkpoints of another "
                    f"run ({runs}); this run would overwrite them. Pass another "
                    f"checkpoint_path, move those files away, or continue that run with "
                    f"trainer.restore(<one of them>).")
            if later:
                raise ckpt.CheckpointError(
                    f"The checkpoint folder {self.folder!r} holds checkpoints of this run after "
                    f"epoch {epoch} ({', '.join(later[:3])}{' ...' if len(later) > 3 else ''}), "
                    f"which training on from epoch {epoch} would overwrite. Restore the latest "
                    f"one, pass another checkpoint_path, or move them away.")

        if not self._folder_checked:
            on_root(self.strategy, check, only_root=True)
            self._folder_checked = True

    def save_epoch(self, epoch: int, trees: Mapping, meta: Mapping) -> str:
        """Save the checkpoint of a completed epoch as ``folder/epoch_NNNNN.npz``."""
        self.check_folder(epoch - 1)
        path = self.epoch_path(epoch)
        self.save(path, trees, meta)
        return path

    def load(self, path: str, templates: Mapping, check: Callable | None = None):
        """Read a checkpoint on the root and send it to every process.

        ``templates`` maps tree names to this run's host pytrees (the
        structure, shapes and dtypes every leaf is checked against); ``check``
        is called with the metadata and raises ``CheckpointError`` for runs
        that cannot continue (other world size, ...). Error states are
        refused. Returns ``(meta, trees)`` on every process and adopts the
        checkpoint's run id, so the run may go on writing into its folder.
        """
        def read():
            meta, leaves = ckpt.load(path)
            check_kind(path, meta, ("checkpoint",))
            if meta.get("trainer", self.trainer) != self.trainer:
                raise ckpt.CheckpointError(f"{path!r} was written by {meta['trainer']}, not "
                                           f"{self.trainer}.")
            if check is not None:
                check(meta)
            missing = [name for name in templates if name not in leaves]
            if missing:
                raise ckpt.CheckpointError(f"{path!r} lacks the part(s) {missing}.")
            trees = {name: ckpt.unflatten_like(templates[name], leaves[name],
                                               meta["trees"][name], name)
                     for name in templates}
            return meta, trees

        self.strategy.check_same(os.fspath(path), "the checkpoint to restore")
        result = on_root(self.strategy, read, only_root=True)
        meta = self.strategy.bcast_object(result[0] if result is not None else None)
        trees = self.strategy.broadcast_from_root(result[1] if result is not None else
                                                  {k: jax.tree.map(np.asarray, v)
                                                   for k, v in templates.items()})
        self.run_id = meta.get("run_id", self.run_id)
        self._folder_checked = False   # the next save checks the folder for this run
        return meta, trees

    def fail(self, message: str, trees: Mapping, meta: Mapping,
             name: str = "error_state") -> NoReturn:
        """Write ``folder/<name>.npz`` (kind 'error_state', refused by
        :meth:`load`) and raise :class:`TrainingError` on every process. If
        the file cannot be written the TrainingError still comes, saying so."""
        path = os.path.join(self.folder, f"{name}.npz")
        try:
            self.save(path, trees, dict(meta, error=message), kind="error_state")
            where = f"{path} holds it for diagnosis"
        except ckpt.CheckpointError as e:
            where = f"the error state could not be written ({e})"
        raise raised_everywhere(TrainingError(
            f"{message} The update was not applied; the trainer holds the last good state, "
            f"and {where}."))


#: the file that names the run owning a checkpoint folder (see :func:`claim_folder`)
OWNER_FILE = ".chemtrain-run"

def claim_folder(folder: str, run_id: str) -> str | None:
    """Atomically make ``run_id`` the owner of ``folder`` unless another run
    already is; return the owner. The owner file is written whole under a
    temporary name and linked into place: of two runs claiming at once,
    exactly one succeeds and the other reads its id. A folder that cannot
    be written returns ``run_id`` (the checkpoint write reports the error)."""
    owner = os.path.join(folder, OWNER_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{owner}.{run_id}.tmp"
        with open(tmp, "w") as f:
            f.write(run_id)
        try:
            os.link(tmp, owner)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        with open(owner) as f:
            return f.read().strip() or None
    except OSError:
        return run_id


def _epoch_of(path: str) -> int:
    name = os.path.basename(os.path.normpath(path))
    try:
        return int(name[len("epoch_"):].removesuffix(".npz"))
    except ValueError:
        return -1


def read_meta(path: str) -> dict | None:
    """A checkpoint's header (its metadata), without reading its arrays
    (None when the file is missing or not readable as a checkpoint)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(z["__meta__"].tobytes().decode())
    except Exception:  # noqa: BLE001 - any unreadable file counts as foreign
        return None


def read_run_id(path: str) -> str | None:
    """The run id in a checkpoint's header (None when the file is not
    readable as a checkpoint)."""
    meta = read_meta(path)
    return None if meta is None else meta.get("run_id")

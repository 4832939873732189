"""ForceMatching: fit an energy function to reference energies and forces.

A thin stateful shell: it keeps parameters, optimizer state, histories and
files; the numbers come from :mod:`chemtrain.learn.force_matching` and the
parallel method from :mod:`chemtrain.parallel` (the trainer never asks which).
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
import zlib
from typing import Callable, Mapping

import jax
import numpy as np
import optax

from .. import checkpoint as ckpt
from ..data import InMemoryLoader, split_dataset, validate_dataset
from ..data.loader import VALID, describe
from ..learn import force_matching as fm
from ..learn.step import make_reduced, make_update
from ..parallel import make_strategy
from ._progress import progress_bar

log = logging.getLogger("chemtrain")

STAGES = ("training", "validation", "testing")


_add = jax.jit(lambda a, b: jax.tree.map(lambda x, y: x + y, a, b))


class TrainingError(RuntimeError):
    """A training step failed (non-finite loss, neighbor-list overflow).

    The failed update was not applied: ``trainer.params`` is the last good
    state, and an error-state file was written for diagnosis.
    """


class ForceMatching:
    """Train ``energy_fn_template`` on energies ``U`` and forces ``F``.

    Args:
      init_params: initial parameter pytree (root's copy wins in parallel runs).
      optimizer: an ``optax.GradientTransformation``.
      energy_fn_template: ``params -> energy_fn(positions, neighbor, **kwargs)``
        returning one structure's potential energy (kJ/mol); forces are minus
        its gradient. Dataset keys other than ``R``, targets and weights arrive
        as keyword arguments (``species``, ``box``, ``mask``, ...).
      nbrs_init: a jax-md neighbor list allocated for the largest structure;
        it is updated for every sample.
      batch: global number of structures per optimizer step; must be
        divisible by the number of shards (devices or ranks).
      parallelism: 'auto', 'single', 'jax' or 'mpi' (see chemtrain.parallel).
      mesh: optional 1-D ``jax.sharding.Mesh`` with axis 'data' for 'jax'.
      gammas: loss weight per target, default ``{'U': 1.0, 'F': 1.0}``;
        leave a target out to not train on it.
      weights_keys: optional ``{target: dataset key}`` of per-sample weights.
      checkpoint_path: folder for checkpoints and error states.
      log_file: JSON-lines metrics file (one line per epoch), or None.
      seed: seed of the training-batch order.
      progress: show tqdm bars (root process only).
      check_vma: shard_map's varying-axis check in 'jax' mode. None (default)
        takes the template's ``check_vma`` attribute if it has one (models
        whose primitives lose the varying type, such as MACE on
        cuequivariance-jax, set it to False), else True.
      consistency_check_every: every k steps compare checksums of the state
        across processes and raise naming the first leaf that differs.
    """

    def __init__(self, init_params, optimizer: optax.GradientTransformation,
                 energy_fn_template: Callable, nbrs_init, *, batch: int | None = None,
                 parallelism: str = "auto", mesh=None, gammas: Mapping[str, float] | None = None,
                 weights_keys: Mapping[str, str] | None = None,
                 checkpoint_path: str = "checkpoints", log_file: str | None = None,
                 seed: int = 0, progress: bool = True, check_vma: bool | None = None,
                 consistency_check_every: int | None = None,
                 batch_per_device: int | None = None, disable_shmap: bool | None = None):
        if disable_shmap:
            raise ValueError("disable_shmap=True is no longer supported: the batch is always "
                             "split with shard_map. Use parallelism='single' for one device or "
                             "parallelism='jax' to split the batch over devices.")
        if check_vma is None:
            check_vma = bool(getattr(energy_fn_template, "check_vma", True))
        self.strategy = make_strategy(parallelism, mesh, check_vma=check_vma)
        # a template may check datasets for inputs it cannot use (unknown elements)
        self._validate_for_model = getattr(energy_fn_template, "validate_dataset", None)
        n = self.strategy.n_shards
        if batch_per_device is not None:
            if batch is not None:
                raise ValueError("Give either batch (global) or the deprecated batch_per_device, not both.")
            warnings.warn(f"batch_per_device is deprecated; pass the global batch instead "
                          f"(batch={batch_per_device * n} here: {batch_per_device} x {n} shards).",
                          DeprecationWarning, stacklevel=2)
            batch = batch_per_device * n
        if batch is None:
            raise ValueError("batch (the global number of structures per step) is required.")
        self.strategy.check_batch(batch)
        self.batch = int(batch)
        self.gammas = dict({"U": 1.0, "F": 1.0} if gammas is None else gammas)
        for t in self.gammas:
            if t not in fm.TARGETS:
                raise ValueError(f"Unknown target {t!r} in gammas; force matching trains {fm.TARGETS}.")
        self.weights_keys = dict(weights_keys or {})
        self.optimizer = optimizer
        self.checkpoint_path = checkpoint_path
        self.log_file = log_file
        self.seed = seed
        self.progress = progress
        self.consistency_check_every = consistency_check_every

        host_params = self.strategy.broadcast_from_root(jax.tree.map(np.asarray, init_params))
        host_opt = self.strategy.broadcast_from_root(
            jax.tree.map(np.asarray, optimizer.init(host_params)))
        self.params = self.strategy.replicate(host_params)
        self.opt_state = self.strategy.replicate(host_opt)
        self.best_params = host_params
        self.best_loss = float("inf")
        self.epoch = 0
        self.step = 0
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.history: list[dict] = []
        self._loaders: dict = {}  # stage -> loader with local_batches(strategy, epoch)

        exclude = {"R", *fm.TARGETS, VALID, *self.weights_keys.values()}
        predict = fm.make_predictor(energy_fn_template, nbrs_init, self.strategy.vary)
        loss_fn = fm.make_shard_loss(predict, self.gammas, self.weights_keys, exclude)
        self._update = make_update(loss_fn, optimizer, self.strategy)
        self._sums = make_reduced(fm.make_metric_sums(predict, self.gammas, self.weights_keys,
                                                      exclude), self.strategy)
        self._predict = self.strategy.compile(
            lambda p, b: predict(p, b["R"], fm.energy_kwargs(b, exclude))[0],
            in_sharded=(False, True), out_sharded=True)
        if self.strategy.is_root:
            log.info("ForceMatching: %s, global batch %d", self.strategy.describe(), self.batch)

    # -- data ---------------------------------------------------------------
    def _required_keys(self):
        return ("R", *self.gammas, *self.weights_keys.values())

    def set_datasets(self, dataset: Mapping | None, train_ratio: float = 0.7,
                     val_ratio: float = 0.1, shuffle: bool = False, seed: int = 0) -> None:
        """Split ``dataset`` (dict of equal-length arrays) into training,
        validation and testing parts and use them.

        Under ``parallelism='mpi'`` only rank 0's ``dataset`` is read (other
        ranks may pass None); rank 0 sends each rank its rows of every batch.
        """
        def split():
            data = self._validate(dataset, self._required_keys(), "dataset")
            return split_dataset(data, train_ratio, val_ratio, shuffle, seed)

        parts = self._on_root(split)
        stages = self._on_root(lambda: [k for k, v in parts.items() if len(v["R"])], share=True)
        for stage in STAGES:
            self._loaders.pop(stage, None)
        for stage in stages:
            self.set_dataset(parts[stage] if parts is not None else None, stage)

    def set_dataset(self, dataset: Mapping | None, stage: str = "training") -> None:
        """Use ``dataset`` for one stage ('training', 'validation', 'testing')."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}.")
        train = stage == "training"
        loader = self._make_loader(dataset, f"{stage} dataset", shuffle=train, drop_last=train)
        if train and loader.n < self.batch:
            raise ValueError(f"The training set has {loader.n} structures, fewer than "
                             f"batch={self.batch}; lower batch or add data.")
        self._loaders[stage] = loader

    def set_loader(self, loader, stage: str = "training") -> None:
        """Use a loader that reads for itself, such as
        :class:`chemtrain.data.HDF5ParallelDataLoader`, for one stage."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}.")
        loader.configure(self.batch, training=stage == "training", seed=self.seed,
                         strategy=self.strategy, required=self._required_keys())
        self._loaders[stage] = loader

    def _make_loader(self, dataset, name, shuffle, drop_last, required=None):
        required = self._required_keys() if required is None else required
        data = self._on_root(lambda: self._validate(dataset, required, name))
        info = self._on_root(lambda: {"n": int(len(data["R"])), "schema": describe(data)},
                             share=True)
        schema = {k: (tuple(shape), dtype) for k, (shape, dtype) in info["schema"].items()}
        return InMemoryLoader(data, self.batch, shuffle=shuffle, seed=self.seed,
                              drop_last=drop_last, n=info["n"], schema=schema)

    def _validate(self, dataset, required, name):
        data = validate_dataset(dataset, required, name=name)
        if self._validate_for_model is not None:
            self._validate_for_model(data)
        return data

    def _on_root(self, fn, share=False):
        """Run ``fn`` where the data lives: everywhere, or only on the root for
        strategies that scatter from it. An error there is raised on every
        process; ``share`` sends the root's (JSON-like) result to all."""
        if not self.strategy.scatters_from_root:
            return fn()
        result, error = None, None
        if self.strategy.is_root:
            try:
                result = fn()
            except (TypeError, ValueError) as e:
                error = (type(e).__name__, str(e))
        error = self.strategy.bcast_object(error)
        if error is not None:
            raise {"TypeError": TypeError}.get(error[0], ValueError)(error[1])
        return self.strategy.bcast_object(result) if share else result

    def _loader(self, stage):
        if stage not in self._loaders:
            raise ValueError(f"No {stage} data: call set_datasets() or set_dataset(data, {stage!r}).")
        return self._loaders[stage]

    def _batches(self, loader, epoch=0):
        for local in loader.local_batches(self.strategy, epoch):
            yield self.strategy.place_batch(local)

    # -- training -----------------------------------------------------------
    def train(self, max_epochs: int, checkpoint_freq: int | None = None) -> None:
        """Train ``max_epochs`` more epochs; checkpoint every ``checkpoint_freq``.

        In a multi-process run an exception on one process stops all of them
        (see ``Strategy.failure_guard``)."""
        with self.strategy.failure_guard():
            self._train(max_epochs, checkpoint_freq)

    def _train(self, max_epochs, checkpoint_freq):
        loader = self._loader("training")
        root = self.strategy.is_root
        epochs = progress_bar(range(self.epoch, self.epoch + max_epochs), desc="epochs",
                              disable=not (root and self.progress), position=0)
        for epoch in epochs:
            start = time.perf_counter()
            n_steps, total, prev = 0, None, None  # memory stays flat however long the epoch
            bar = progress_bar(total=len(loader), desc=f"epoch {epoch}", leave=False,
                               disable=not (root and self.progress), position=1)
            for batch in self._batches(loader, epoch):
                self.params, self.opt_state, s = self._update(self.params, self.opt_state, batch)
                summed = {"loss": s["loss"], "parts": s["parts"]}
                total = summed if total is None else _add(total, summed)
                n_steps += 1
                done = self.step + n_steps
                if self.consistency_check_every and done % self.consistency_check_every == 0:
                    self.check_consistency(done)
                if prev is not None:  # check the previous step while this one runs
                    bar.set_postfix(loss=f"{self._check_step(prev, s, n_steps - 2, epoch):.4g}")
                prev = s
                bar.update()
            bar.close()
            if prev is not None:
                self._check_step(prev, None, n_steps - 1, epoch)
            self.step += n_steps
            host = self.strategy.to_host(total)
            train_loss = float(host["loss"]) / n_steps
            parts = {t: float(host["parts"][t]) / n_steps for t in self.gammas}
            self.train_losses.append(train_loss)
            record = {"epoch": epoch, "step": self.step, "train_loss": train_loss, "train_parts": parts}
            monitored = train_loss
            if "validation" in self._loaders:
                val = self.evaluate("validation")
                self.val_losses.append(val["loss"])
                record["val_loss"] = val["loss"]
                record["val"] = {t: val[t] for t in self.gammas}
                monitored = val["loss"]
            self.epoch = epoch + 1
            if monitored < self.best_loss:
                self.best_loss = monitored
                self.best_params = self.strategy.to_host(self.params)
            record["time_s"] = self.strategy.host_max(time.perf_counter() - start)
            self.history.append(record)
            self._report(record, epochs)
            if checkpoint_freq and self.epoch % checkpoint_freq == 0:
                self.save_checkpoint(os.path.join(self.checkpoint_path, f"epoch_{self.epoch:05d}.npz"))

    def _check_step(self, stats, later, index, epoch) -> float:
        """Loss of step ``index`` of this epoch (its ``stats``); on a failed
        step write the error state and raise. ``later`` are the stats of the
        step dispatched after it, if any."""
        ok, loss, nbr_errors = self.strategy.to_host((stats["ok"], stats["loss"], stats["nbr_errors"]))
        if bool(ok):
            return float(loss)
        # steps before this one were applied, this one not; the later one may have been
        self.step += index + (int(self.strategy.to_host(later["ok"])) if later is not None else 0)
        if int(nbr_errors):
            msg = (f"The neighbor list overflowed (or saw an invalid box) for {int(nbr_errors)} "
                   f"structure(s) in step {index} of epoch {epoch}. Allocate nbrs_init on the "
                   f"densest, largest structure with a larger capacity_multiplier.")
        else:
            msg = (f"The loss is {float(loss)} in step {index} of epoch {epoch}. Lower the "
                   f"learning rate or check the data and the energy function.")
        path = os.path.join(self.checkpoint_path, "error_state.npz")
        self.save_checkpoint(path, kind="error_state", error=msg)
        raise TrainingError(f"{msg} The update was not applied; trainer.params holds the last good "
                            f"state, and {path} holds it for diagnosis.")

    def _report(self, record, bar):
        if not self.strategy.is_root:
            return
        text = f"epoch {record['epoch']}: train loss {record['train_loss']:.5g}"
        if "val_loss" in record:
            text += f", val loss {record['val_loss']:.5g}"
            if "F" in record["val"]:
                text += f", val force MAE {record['val']['F']['MAE']:.4g} kJ/mol/nm"
        text += f" ({record['time_s']:.2f} s)"
        log.info(text)
        bar.set_postfix(train=f"{record['train_loss']:.4g}",
                        val=f"{record.get('val_loss', float('nan')):.4g}")
        if self.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
            with open(self.log_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    # -- evaluation ---------------------------------------------------------
    def check_consistency(self, step: int | None = None) -> None:
        """Compare checksums of every parameter and optimizer-state leaf across
        processes; raise naming the first leaf whose replicas differ."""
        flat, _ = jax.tree_util.tree_flatten_with_path(
            {"params": self.strategy.to_host(self.params),
             "opt_state": self.strategy.to_host(self.opt_state)})
        sums = np.array([zlib.crc32(np.ascontiguousarray(v).tobytes()) for _, v in flat], np.int64)
        for proc, other in enumerate(self.strategy.host_allgather(sums)):
            diff = np.nonzero(np.asarray(other) != sums)[0]
            if diff.size:
                raise TrainingError(
                    f"Replicas diverged after step {self.step if step is None else step}: "
                    f"{jax.tree_util.keystr(flat[diff[0]][0])} differs between process "
                    f"{self.strategy.process_index} and process {proc} "
                    f"({diff.size} leaf/leaves differ in all).")

    def evaluate(self, stage: str = "validation", params=None) -> dict:
        """MAE and RMSE per target and the mean per-structure loss of a stage.

        Sums over all batches and shards are divided once, so padding the last
        batch changes nothing. Errors are in kJ/mol (U) and kJ/mol/nm (F).
        """
        with self.strategy.failure_guard():
            return self._evaluate(stage, self.params if params is None else params)

    def _evaluate(self, stage, params):
        total = None
        for batch in self._batches(self._loader(stage)):
            s = self._sums(params, batch)
            total = s if total is None else _add(total, s)
        host = jax.tree.map(lambda x: np.asarray(x, np.float64), self.strategy.to_host(total))
        if host["nbr_errors"]:
            raise TrainingError(f"The neighbor list overflowed for {int(host['nbr_errors'])} "
                                f"{stage} structure(s); allocate nbrs_init with more capacity.")
        return fm.finish_metrics(host, self.gammas)

    def predict(self, dataset: Mapping | None) -> dict:
        """Energies ``U`` (n,) and forces ``F`` (n, atoms, 3) of ``dataset`` as
        numpy, on every process (under MPI only rank 0's dataset is read)."""
        loader = self._make_loader(dataset, "dataset", shuffle=False, drop_last=False,
                                   required=("R",))
        out = [self.strategy.to_host(self._predict(self.params, batch), sharded=True)
               for batch in self._batches(loader)]
        return {k: np.concatenate([o[k] for o in out])[:loader.n] for k in ("U", "F")}

    def predict_batch(self, local_batch: Mapping) -> dict:
        """Device predictions of one batch (this process's rows as numpy);
        in 'jax' mode sharded along the leading axis."""
        local = dict(local_batch)
        local.setdefault(VALID, np.ones(local["R"].shape[0], bool))
        return self._predict(self.params, self.strategy.place_batch(local))

    # -- checkpoints --------------------------------------------------------
    def save_checkpoint(self, path: str, kind: str = "checkpoint", error: str | None = None) -> None:
        """Write the full training state to ``path`` (root process, atomic)."""
        trees = {"params": self.strategy.to_host(self.params),
                 "opt_state": self.strategy.to_host(self.opt_state),
                 "best_params": self.best_params}
        meta = {"kind": kind, "epoch": self.epoch, "step": self.step,
                "n_shards": self.strategy.n_shards, "parallelism": self.strategy.name,
                "batch": self.batch, "seed": self.seed, "best_loss": self.best_loss,
                "train_losses": self.train_losses, "val_losses": self.val_losses,
                "history": self.history, "error": error}
        error = None
        if self.strategy.is_root:
            try:
                ckpt.save(path, trees, meta)
                log.info("Saved %s to %s (epoch %d)", kind, path, self.epoch)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        error = self.strategy.bcast_object(error)  # every process learns the outcome
        if error:
            raise ckpt.CheckpointError(f"Writing the checkpoint {path!r} failed on the root: {error}")

    def restore(self, path: str) -> None:
        """Continue from a checkpoint written by :meth:`save_checkpoint`."""
        meta, leaves = ckpt.load(path)
        if meta.get("kind") != "checkpoint":
            raise ckpt.CheckpointError(f"{path!r} is an {meta.get('kind')} written after a failure "
                                       f"({meta.get('error')}); it is for diagnosis, not for resuming.")
        if meta["n_shards"] != self.strategy.n_shards or meta["batch"] != self.batch:
            raise ckpt.CheckpointError(
                f"{path!r} was written by a run with {meta['n_shards']} shard(s) and batch "
                f"{meta['batch']}; this run has {self.strategy.n_shards} and {self.batch}. "
                f"Resume with the same number of devices/ranks and the same batch.")
        host = {name: ckpt.unflatten_like(template, leaves[name], meta["trees"][name], name)
                for name, template in (("params", self.strategy.to_host(self.params)),
                                       ("opt_state", self.strategy.to_host(self.opt_state)),
                                       ("best_params", self.best_params))}
        self.params = self.strategy.replicate(host["params"])
        self.opt_state = self.strategy.replicate(host["opt_state"])
        self.best_params = host["best_params"]
        self.epoch, self.step, self.seed = meta["epoch"], meta["step"], meta["seed"]
        self.best_loss = meta["best_loss"]
        self.train_losses, self.val_losses = list(meta["train_losses"]), list(meta["val_losses"])
        self.history = list(meta["history"])
        for loader in self._loaders.values():
            loader.seed = self.seed

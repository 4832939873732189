"""ForceMatching: fit an energy function to reference energies and forces.

A thin shell over :mod:`chemtrain.learn.force_matching` (the numbers),
:mod:`chemtrain.parallel` (the method, never asked), :mod:`.stages` (data)
and :mod:`.services` (reports, checkpoints, failed steps).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

import jax
import numpy as np
import optax

from ..compile_cache import enable as enable_compile_cache
from ..data.loader import VALID
from ..learn import force_matching as fm
from ..learn import optimizers
from ..learn.diagnose import energy_gradient_note
from ..learn.losses import check_losses
from ..models.template import as_template, check_reach
from ..parallel import make_strategy, raised_everywhere
from .epochs import run_epochs
from .report import Reporter, check_epochs, close_epoch
from .checkpoints import CheckpointStore
from .options import RunOptions, run_options
from .services import (TrainingError, add_trees, check_consistency, collective,
                       init_state, run_steps)
from .stages import DataStages, global_batch
from .state import FMState, HoldsState

log = logging.getLogger("chemtrain")


def epoch_line(record: Mapping) -> str:
    """The default text of an epoch's log line, in chemtrain's units:
    ``"train loss 0.886, val loss 0.2596, val force MAE 373.7 kJ/mol/nm"``."""
    text = f"train loss {record['train_loss']:.5g}"
    if "val_loss" in record:
        text += f", val loss {record['val_loss']:.5g}"
        if "F" in record.get("val", {}):
            text += f", val force MAE {record['val']['F']['MAE']:.4g} kJ/mol/nm"
    return text


class ForceMatching(HoldsState):
    """Train ``energy_fn_template`` on energies ``U`` and forces ``F``.

    Args:
      init_params: initial parameter pytree (root's copy wins in parallel runs).
      optimizer: an ``optax.GradientTransformation``.
      energy_fn_template: ``params -> energy_fn(positions, neighbor, **kwargs)``
        returning one structure's energy (kJ/mol), or a
        :class:`chemtrain.models.EnergyTemplate`. Dataset keys other than
        ``R``, targets and weights arrive as keyword arguments.
      nbrs_init: a jax-md neighbor list for the largest structure (None: graphs in the data).
      batch: global structures per step, divisible by the number of shards.
      parallelism: 'auto', 'single', 'jax' or 'mpi' (see chemtrain.parallel).
      mesh: optional 1-D ``jax.sharding.Mesh`` with axis 'data' for 'jax'.
      gammas: non-negative loss weight per target (default U and F 1.0).
      weights_keys: optional ``{target: dataset key}`` of per-structure weights.
      checkpoint_path: folder for checkpoints and error states (upstream's
        keyword; or ``options.checkpoint_path``; default ``"checkpoints"``).
      log_file: JSON-lines metrics file (one line per epoch), or None
        (upstream's keyword; or ``options.log_file``).
      seed: seed of the training-batch order.
      check_vma: shard_map's varying-axis check; None takes the template's.
      batch_per_device: structures per device instead of ``batch``.
      disable_shmap: evaluate the batch without ``shard_map`` (single device).
      functions: the factory of what the trainer computes, with the
        signature of :func:`chemtrain.learn.force_matching.trainer_functions`
        (the default: one model); :class:`EnsembleOfModels` passes a
        committee's (:func:`chemtrain.learn.ensemble.trainer_functions`).
      losses: ``{target: loss}`` of :mod:`chemtrain.learn.losses` (e.g.
        ``{"F": huber(50.0)}``, or a ``TargetLoss`` comparing energies per
        atom); targets not named keep the squared error.
      options: a :class:`~chemtrain.trainers.RunOptions`: ``progress``,
        ``consistency_check_every`` (every k steps compare checksums of the
        state across processes) and ``epoch_line`` (``record -> str``, the
        text of each epoch's log line after ``"epoch k: "``, from the record
        the metrics file gets: ``train_loss``, ``val_loss``,
        ``val[target]["MAE"/"RMSE"]`` in kJ/mol and kJ/mol/nm; default
        :func:`epoch_line`; ``chemtrain-finetune`` passes one in eV/Å).

    The optimizer may carry :func:`chemtrain.learn.optimizers.ema` (then
    validation, ``evaluate``, ``predict``, ``best_params`` and
    ``eval_params`` use the averaged parameters, as mace-torch's ``--ema``)
    and :func:`~chemtrain.learn.optimizers.reduce_on_plateau` (fed each
    epoch's monitored loss: the validation loss, else the training loss).

    The resumable state is one :class:`~chemtrain.trainers.state.FMState`,
    ``trainer.state``; ``params``, ``opt_state``, ``epoch``, ``step``,
    ``history`` and the other fields read it. Assigning ``trainer.params``
    hands in new parameters of the same structure (e.g. from another
    trainer of the same model); the optimizer state is kept.
    """

    OPTIONS = ("checkpoint_path", "log_file", "progress", "consistency_check_every", "epoch_line")

    def __init__(self, init_params, optimizer: optax.GradientTransformation, energy_fn_template,
                 nbrs_init, *, batch: int | None = None, parallelism: str = "auto", mesh=None,
                 gammas: Mapping[str, float] | None = None, weights_keys: Mapping | None = None,
                 checkpoint_path: str | None = None, log_file: str | None = None, seed: int = 0,
                 check_vma: bool | None = None, batch_per_device: int | None = None,
                 disable_shmap: bool | None = None, functions: Callable | None = None,
                 losses: Mapping | None = None, options: RunOptions | None = None):
        global_batch(batch, batch_per_device, 1, disable_shmap)  # argument errors first
        self.options = run_options(options, type(self).__name__, self.OPTIONS,
                                   checkpoint_path=checkpoint_path, log_file=log_file)
        enable_compile_cache()
        template = as_template(energy_fn_template)
        check_reach(template, nbrs_init, "ForceMatching")
        self.strategy = make_strategy(parallelism, mesh, check_vma=template.check_vma
                                      if check_vma is None else check_vma)
        with self.strategy.failure_guard():
            batch = global_batch(batch, batch_per_device, self.strategy.n_shards, warn=True)
            self.strategy.check_batch(batch)
            self.batch, self.optimizer = int(batch), optimizer
            self.gammas, self.weights_keys = fm.check_gammas(gammas), dict(weights_keys or {})
            self.losses = check_losses(losses, self.gammas)
            self.consistency_check_every = self.options.consistency_check_every
            self.epoch_line = self.options.epoch_line or epoch_line
            self._diagnose = (template, nbrs_init)   # for the message of a failed step
            self.reporter = Reporter(self.strategy, self.options.log_file, self.options.progress)
            self.store = CheckpointStore(self.strategy, self.options.checkpoint_path
                                         or "checkpoints", "ForceMatching")
            self.data = DataStages(self.strategy, self.batch, ("R", *self.gammas,
                                   *self.weights_keys.values()), self.weights_keys.values(),
                                   template.validate_dataset, nbrs_init, seed)
            params, opt_state, host_params = init_state(self.strategy, init_params, optimizer)
            self.state = FMState(params, opt_state, host_params, seed=seed)
            self.stopped_early = False
            exclude = {"R", *fm.TARGETS, VALID, *self.weights_keys.values()}
            self.functions = (functions or fm.trainer_functions)(
                template, nbrs_init, optimizer, self.strategy, self.gammas, self.weights_keys,
                exclude, losses=self.losses)
        if self.strategy.is_root:
            log.info("ForceMatching: %s, global batch %d", self.strategy.describe(), self.batch)

    # -- state --------------------------------------------------------------
    opt_state = property(lambda self: self.state.opt_state)
    best_params = property(lambda self: self.state.best_params)
    best_loss = property(lambda self: self.state.best_loss)
    epoch = property(lambda self: self.state.epoch)
    step = property(lambda self: self.state.step)
    seed = property(lambda self: self.state.seed)
    train_losses = property(lambda self: self.state.train_losses)
    val_losses = property(lambda self: self.state.val_losses)
    history = property(lambda self: self.state.history)

    @property
    def eval_params(self):
        """The parameters that are evaluated and exported: the optimizer's
        moving average (:func:`chemtrain.learn.optimizers.ema`) when it
        keeps one, else the trained parameters."""
        averaged = optimizers.averaged(self.state.opt_state)
        return self.state.params if averaged is None else averaged

    def epochs_since_best(self) -> int:
        """Epochs trained since the monitored loss was lowest (0 when the
        last epoch was the best, and while there is no best loss: before the
        first epoch, or after ``best_loss`` was reset to inf)."""
        if not np.isfinite(self.state.best_loss):   # no best yet (or reset, as a new stage)
            return 0
        if self.state.best_epoch >= 0:
            return self.state.epoch - 1 - self.state.best_epoch
        # a checkpoint of an older version: the first epoch with the best loss set it
        losses = self.state.val_losses or self.state.train_losses
        at = [i for i, v in enumerate(losses) if v == self.state.best_loss]
        return len(losses) - 1 - at[0] if at else len(losses)

    def _capture(self):
        trees, meta = self.store.host(self.state)
        return trees, dict(meta, **self._resume_settings())

    def _resume_settings(self) -> dict:
        """What a checkpoint records and a resume must share, besides the
        number of shards: the global batch."""
        return {"batch": self.batch}

    # -- data ---------------------------------------------------------------
    @collective
    def set_datasets(self, dataset: Mapping | None, train_ratio: float = 0.7,
                     val_ratio: float = 0.1, shuffle: bool = False, seed: int = 0) -> None:
        """Split ``dataset`` (dict of equal-length arrays) into training,
        validation and testing parts and use them. Under MPI only rank 0's
        ``dataset`` is read (others may pass None); it sends each rank its rows."""
        self.data.set_split(dataset, train_ratio, val_ratio, shuffle, seed)

    @collective
    def set_dataset(self, dataset: Mapping | None, stage: str = "training") -> None:
        """Use ``dataset`` for one stage ('training', 'validation', 'testing')."""
        self.data.set(dataset, stage)

    @collective
    def set_loader(self, loader, stage: str = "training") -> None:
        """Use a loader that reads for itself (:class:`chemtrain.data.Loader`,
        e.g. ``HDF5ParallelDataLoader``) for one stage."""
        self.data.set_loader(loader, stage)

    def _batches(self, loader, epoch=0):
        return map(self.strategy.place_batch, loader.local_batches(self.strategy, epoch))

    # -- training -----------------------------------------------------------
    @collective
    def train(self, max_epochs: int, checkpoint_freq: int | None = None,
              patience: int | None = None) -> None:
        """Train ``max_epochs`` more epochs; checkpoint every ``checkpoint_freq``.

        With ``patience``, stop early once the monitored loss (validation,
        else training) has not improved for ``patience`` epochs in a row
        (mace-torch's ``--patience``); the count comes from the state's
        losses, so it continues across a restore. ``best_params`` then hold
        the best epoch's parameters. Whether the run stopped early is
        ``trainer.stopped_early``.
        """
        check_epochs(max_epochs, checkpoint_freq)
        if patience is not None and (isinstance(patience, bool) or int(patience) != patience
                                     or patience < 1):
            raise ValueError(f"patience must be a whole number of epochs >= 1 (or None: no "
                             f"early stopping), got {patience!r}.")
        self.stopped_early = False
        if patience is not None and self.epochs_since_best() >= patience:
            self.stopped_early = True
            if self.strategy.is_root:
                log.info("Not training: the monitored loss has not improved for %d epochs "
                         "(patience %d).", self.epochs_since_best(), patience)
            return
        loader = self.functions.training_loader(self.data["training"])

        def stop(epoch):
            if patience is None or self.epochs_since_best() < patience:
                return False
            self.stopped_early = True
            if self.strategy.is_root:
                log.info("Stopping early after epoch %d: the monitored loss has not improved "
                         "for %d epochs (best %.5g).", epoch, patience, self.state.best_loss)
            return True
        run_epochs(self, max_epochs, checkpoint_freq,
                   lambda epoch, bar: self._epoch(loader, epoch, bar),
                   lambda: self.store.save_epoch(self.epoch, *self._capture()), stop)

    def _epoch(self, loader, epoch: int, epochs_bar) -> None:
        """Train, validate, report and commit one epoch."""
        start = time.perf_counter()
        n_steps, total = run_steps(
            self.strategy, self._step, self._batches(loader, epoch),
            lambda s, i, applied: self._failed(s, i, applied, epoch),
            self.reporter.bar(len(loader), f"epoch {epoch}"), self.step,
            self.consistency_check_every, self.check_consistency)
        step = self.state.step + n_steps
        self.state = self.state.replace(step=step)
        record = {"epoch": epoch, "step": step, **self.functions.train_record(
            self.strategy.to_host(total), n_steps, self.gammas)}
        monitored = record["train_loss"]
        done = dict(train_losses=[*self.state.train_losses, monitored])
        if "validation" in self.data:
            val = self.evaluate("validation")
            monitored = val["loss"]
            done["val_losses"] = [*self.state.val_losses, monitored]
            record.update(val_loss=monitored, **self.functions.val_record(val, self.gammas))
        text = f"epoch {epoch}: " + self.epoch_line(record)
        if monitored < self.state.best_loss:
            done.update(best_loss=monitored, best_epoch=epoch,
                        best_params=self.strategy.to_host(self.eval_params))
        opt_state, fed = optimizers.after_epoch(self.state.opt_state, monitored,
                                                self.strategy.to_host, self.strategy.replicate)
        record.update(fed)
        close_epoch(self.strategy, self.reporter, record, text, epochs_bar, start,
                    train=f"{record['train_loss']:.4g}",
                    val=f"{record.get('val_loss', float('nan')):.4g}")
        self.state = self.state.replace(epoch=epoch + 1, history=[*self.state.history, record],
                                        opt_state=opt_state, **done)

    def _step(self, batch):
        params, opt_state, s = self.functions.update(self.state.params, self.state.opt_state,
                                                     batch)
        self.state = self.state.replace(params=params, opt_state=opt_state)
        return dict(s, sum={"loss": s["loss"], "parts": s["parts"]})

    def _failed(self, stats, index, applied, epoch):
        self.state = self.state.replace(step=self.state.step + applied)
        nbr_errors, loss, grad_ok, update_ok = self.strategy.to_host(
            (stats["nbr_errors"], stats["loss"], stats["grad_ok"], stats["update_ok"]))
        message = fm.failed_step_message(int(nbr_errors), float(loss),
                                         f"step {index} of epoch {epoch}", bool(grad_ok),
                                         bool(update_ok))
        template, nbrs = self._diagnose
        if not int(nbr_errors) and nbrs is not None:
            note = energy_gradient_note(template, self.strategy.to_host(self.params),
                                        nbrs.reference_position, nbrs)
            message += f" Likely cause: {note}" if note else ""
        self.store.fail(message, *self._capture())

    # -- evaluation ---------------------------------------------------------
    @collective
    def check_consistency(self, step: int | None = None) -> None:
        """Raise ``TrainingError`` naming the first leaf of parameters or
        optimizer state whose replicas differ between processes."""
        check_consistency(self.strategy, self.store.host(self.state)[0],
                          self.step if step is None else step)

    @collective
    def evaluate(self, stage: str = "validation", params=None) -> dict:
        """MAE and RMSE per target (kJ/mol, kJ/mol/nm) and the mean
        per-structure loss of a stage, exact whatever the padding."""
        total = None
        params = self.eval_params if params is None else self.strategy.replicate(params)
        for batch in self._batches(self.data[stage]):
            total = add_trees(total, self.functions.sums(params, batch))
        host = jax.tree.map(lambda x: np.asarray(x, np.float64), self.strategy.to_host(total))
        if host["nbr_errors"]:  # global sums: every process raises
            raise raised_everywhere(TrainingError(
                f"The neighbor list overflowed for {int(host['nbr_errors'])} {stage} "
                f"structure(s); allocate nbrs_init with more capacity."))
        return self.functions.finish(host, self.gammas)

    @collective
    def predict(self, dataset: Mapping | None, params=None) -> dict:
        """Energies ``U`` (n,) and forces ``F`` (n, atoms, 3) of ``dataset`` as
        numpy (a trainer with a stress target also gives ``stress`` (n, 3, 3)
        and ``has_stress``), on every process (under MPI only rank 0's
        dataset is read), by :attr:`eval_params` or the given ``params``
        (e.g. ``best_params``). The compiled model is the one ``evaluate``
        runs: predicting data of the same shapes compiles nothing new."""
        params = self.eval_params if params is None else self.strategy.replicate(params)
        loader = self.data.in_memory(dataset, "dataset", shuffle=False, drop_last=False,
                                     required=("R",))
        out = [self.strategy.to_host(self.functions.predict(params, batch), sharded=True)
               for batch in self._batches(loader)]
        return {k: np.concatenate([o[k] for o in out])[:loader.n] for k in out[0]}

    def predict_batch(self, local_batch: Mapping) -> dict:
        """Device predictions of one batch (this process's rows as numpy)."""
        local = {VALID: np.ones(np.shape(local_batch["R"])[0], bool), **local_batch}
        return self.functions.predict(self.eval_params, self.strategy.place_batch(local))

    # -- checkpoints --------------------------------------------------------
    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write the full training state to ``path`` (root process, atomic)."""
        self.store.save(path, *self._capture())

    @collective
    def restore(self, path: str) -> None:
        """Continue from a checkpoint written by this trainer (read on the root)
        with the same global batch (a committee: and bootstrap), on any number
        of devices or ranks."""
        self.state, _ = self.store.restore(
            path, self.state, self._resume_settings())
        self.data.reseed(self.seed)

"""Training, validation and testing data of a trainer that learns from
structures: validation against the model, in-memory and self-reading loaders.

Under MPI in-memory data live on the root (see
:func:`chemtrain.parallel.on_root`); every error is raised on every process
with its own class.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ..data import InMemoryLoader, split_dataset, validate_dataset
from ..data.dataset import STRESS_WEIGHT
from ..data.loader import Loader, describe
from ..neighbors import GRAPH_KEYS, check_minimum_image, list_cutoff
from ..parallel import on_root

STAGES = ("training", "validation", "testing")


class DataStages:
    """Loaders per stage for a global ``batch``.

    Args:
      strategy: the run's parallel strategy.
      batch: global structures per step.
      required: dataset keys every stage needs (positions, targets, weights).
      weights: keys of per-structure weights (checked to be >= 0).
      validate_for_model: the model's own check (``EnergyTemplate.validate_dataset``).
      nbrs_init: the neighbor list; positions of another dtype than it was
        allocated with are refused, and so are periodic cells narrower than
        twice its cutoff (:func:`chemtrain.neighbors.list_cutoff`) unless
        the data carry precomputed graphs. None: every dataset must carry
        graphs.
      seed: seed of the training-batch order.
    """

    def __init__(self, strategy, batch: int, required, weights=(),
                 validate_for_model: Callable | None = None, nbrs_init=None, seed: int = 0):
        self.strategy = strategy
        self.batch = batch
        self.required = tuple(required)
        self.weights = tuple(weights)
        self.validate_for_model = validate_for_model
        ref = getattr(nbrs_init, "reference_position", None)
        self.positions_dtype = None if ref is None else np.dtype(ref.dtype)
        self.graphs_only = nbrs_init is None
        self.cutoff = None if nbrs_init is None else list_cutoff(nbrs_init)
        self.seed = seed
        self.loaders: dict[str, Loader] = {}

    def __contains__(self, stage):
        return stage in self.loaders

    def __getitem__(self, stage) -> Loader:
        if stage not in self.loaders:
            raise ValueError(f"No {stage} data: call set_datasets() or set_dataset(data, {stage!r}).")
        return self.loaders[stage]

    def set_split(self, dataset, train_ratio, val_ratio, shuffle, seed) -> None:
        def split():
            data = self.validate(dataset, self.required, "dataset")
            return split_dataset(data, train_ratio, val_ratio, shuffle, seed)

        parts = on_root(self.strategy, split)
        stages = on_root(self.strategy, lambda: [k for k, v in parts.items() if len(v["R"])],
                         share=True)
        for stage in STAGES:
            self.loaders.pop(stage, None)
        for stage in stages:
            self.set(parts[stage] if parts is not None else None, stage)

    def set(self, dataset, stage: str) -> None:
        check_stage(stage)
        train = stage == "training"
        loader = self.in_memory(dataset, f"{stage} dataset", shuffle=train, drop_last=train)
        if train and loader.n < self.batch:
            raise ValueError(f"The training set has {loader.n} structures, fewer than "
                             f"batch={self.batch}; lower batch or add data.")
        self.loaders[stage] = loader

    def set_loader(self, loader: Loader, stage: str) -> None:
        check_stage(stage)
        for attr in ("configure", "local_batches", "n"):
            if not hasattr(loader, attr):
                raise TypeError(f"A loader needs configure(), local_batches() and n (see "
                                f"chemtrain.data.Loader); {type(loader).__name__} lacks {attr!r}.")
        loader.configure(self.batch, training=stage == "training", seed=self.seed,
                         strategy=self.strategy, required=self.required, weights=self.weights)
        schema = getattr(loader, "schema", None)
        if schema and "R" in schema:
            self.check_positions_dtype(schema["R"][1], f"the {stage} loader's 'R'")
        if schema:
            name = f"the {stage} loader's data"
            columns = getattr(loader, "read_columns", None)
            cells = ({} if columns is None or "box" not in schema or self.cutoff is None
                     else columns([k for k in ("box", "pbc") if k in schema]))
            self.check_structures(set(schema), self.required, name, cells)
        self.loaders[stage] = loader

    def in_memory(self, dataset, name, shuffle, drop_last, required=None) -> InMemoryLoader:
        required = self.required if required is None else required
        data = on_root(self.strategy, lambda: self.validate(dataset, required, name))
        info = on_root(self.strategy, lambda: {"n": int(len(data["R"])), "schema": describe(data)},
                       share=True)
        schema = {k: (tuple(shape), dtype) for k, (shape, dtype) in info["schema"].items()}
        return InMemoryLoader(data, self.batch, shuffle=shuffle, seed=self.seed,
                              drop_last=drop_last, n=info["n"], schema=schema)

    def validate(self, dataset: Mapping, required, name) -> dict:
        weights = [w for w in self.weights if w in required]
        data = validate_dataset(dataset, required, name=name, weights=weights)
        self.check_positions_dtype(data["R"].dtype, f"{name}['R']")
        self.check_structures(set(data), required, name, data)
        if self.validate_for_model is not None:
            self.validate_for_model(data)
        return data

    def check_positions_dtype(self, dtype, what) -> None:
        if self.positions_dtype is not None and np.dtype(dtype) != self.positions_dtype:
            raise TypeError(
                f"{what} holds {np.dtype(dtype)} positions, but nbrs_init was allocated with "
                f"{self.positions_dtype} positions; jax-md needs one dtype. Convert the data "
                f"(R.astype(np.{self.positions_dtype})) or allocate the neighbor list on "
                f"positions of dtype {np.dtype(dtype)}.")

    def check_structures(self, keys, required, name, cells) -> None:
        """Edges and stress need more than shapes: graphs where there is no
        neighbor list, cells wide enough for a minimum-image list, a cell for
        a stress target, and the stress weights a converted file carries."""
        graphs = [k for k in GRAPH_KEYS if k in keys]
        if not graphs and self.graphs_only:
            raise ValueError(
                f"nbrs_init is None, so {name} must carry precomputed graphs {GRAPH_KEYS}; it has "
                f"{sorted(keys)}. Add them with chemtrain.neighbors.add_graphs(data, cutoff) "
                f"(chemtrain-convert --graph-cutoff for HDF5 files) or pass a jax-md neighbor "
                f"list as nbrs_init.")
        if not graphs and "box" in cells and self.cutoff is not None:
            check_minimum_image(cells["box"], self.cutoff, cells.get("pbc"), name=f"{name}['box']")
        if "stress" in required and "box" not in keys:
            raise ValueError(f"{name}: a stress target needs each structure's cell; add 'box' "
                             f"(structures, 3, 3), zeros for structures without a cell.")
        if "stress" in required and STRESS_WEIGHT in keys and STRESS_WEIGHT not in self.weights:
            raise ValueError(
                f"{name} has {STRESS_WEIGHT!r} (0 for structures without a stress label) but the "
                f"trainer does not use it: pass weights_keys={{'stress': {STRESS_WEIGHT!r}}}, so "
                f"that unlabelled structures are not trained towards zero stress.")

    def reseed(self, seed: int) -> None:
        self.seed = seed
        for loader in self.loaders.values():
            loader.seed = seed


def global_batch(batch, batch_per_device, n_shards, disable_shmap=None, warn=False) -> int:
    """The global batch, also from the deprecated ``batch_per_device``."""
    import warnings
    if disable_shmap:
        raise ValueError("disable_shmap=True is no longer supported: the batch is always split "
                         "with shard_map. Use parallelism='single' for one device or "
                         "parallelism='jax' to split the batch over devices.")
    if batch_per_device is not None:
        if batch is not None:
            raise ValueError("Give either batch (global) or the deprecated batch_per_device, not both.")
        if warn:
            warnings.warn(f"batch_per_device is deprecated; pass the global batch instead (batch="
                          f"{batch_per_device * n_shards} here: {batch_per_device} x {n_shards} "
                          f"shards).", DeprecationWarning, stacklevel=4)
        batch = batch_per_device * n_shards
    if batch is None:
        raise ValueError("batch (the global number of structures per step) is required.")
    return batch


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}.")

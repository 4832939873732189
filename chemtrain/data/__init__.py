"""Datasets and loaders: validation, splitting, padding, batching."""
from .dataset import dataset_length, pad_systems, split_dataset, validate_dataset
from .loader import VALID, InMemoryLoader, Loader


def __getattr__(name):  # h5py is imported only when the HDF5 loader is used
    if name == "HDF5ParallelDataLoader":
        from .hdf5 import HDF5ParallelDataLoader
        return HDF5ParallelDataLoader
    raise AttributeError(f"module 'chemtrain.data' has no attribute {name!r}")

__all__ = ["validate_dataset", "split_dataset", "pad_systems", "dataset_length",
           "InMemoryLoader", "HDF5ParallelDataLoader", "Loader", "VALID"]

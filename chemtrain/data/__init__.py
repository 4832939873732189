"""Datasets and loaders: validation, splitting, padding, batching."""
from .dataset import dataset_length, pad_systems, split_dataset, validate_dataset
from .loader import VALID, InMemoryLoader

__all__ = ["validate_dataset", "split_dataset", "pad_systems", "dataset_length",
           "InMemoryLoader", "VALID"]

"""Test helpers take a trainer's keywords and RunOptions' fields side by
side (``progress=False, on_update=...``)."""
from chemtrain.trainers.options import split_options as with_run_options  # noqa: F401

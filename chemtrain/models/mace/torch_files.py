"""Opening mace-torch ``.model`` files (needs the ``mace-torch`` extra): the
file is a Python pickle that can run code, so it is read only when the
caller says it trusts it (:class:`UntrustedFileError` otherwise); torch and
mace-torch are imported with a clear install hint when missing; and torch's
safe ``torch.load`` default, which importing mace switches off, is restored
afterwards. :mod:`chemtrain.models.mace.torch_io` converts what is read.
"""
from __future__ import annotations

import contextlib
import os
import warnings

INSTALL_HINT = ("Loading mace-torch files needs PyTorch and mace-torch: "
                "pip install 'chemtrain[mace-torch]' (or pip install torch mace-torch).")


class UntrustedFileError(ValueError):
    """A pickle file that was not read because the caller did not say it trusts it.

    A ``ValueError``, raised by :func:`chemtrain.models.mace.load_mace_torch` unless it is called
    with ``trusted=True``.
    """


_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

UNTRUSTED = ("{path!r} was not read: a mace-torch '.model' file is a Python pickle, and "
             "loading it can run any code the file contains. Pass trusted=True only for a "
             "file from a source you trust (e.g. the official MACE-MP release or your own "
             "training run); then convert it once and keep the plain-data copy "
             "(chemtrain.models.mace.save / load), which runs no code.")


@contextlib.contextmanager
def _torch_load_default_kept():
    """Undo, on exit, what importing mace does to torch: ``import mace`` sets
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which makes every later
    ``torch.load`` in the process unpickle arbitrary code by default."""
    before = os.environ.get(_NO_WEIGHTS_ONLY)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_NO_WEIGHTS_ONLY, None)
        else:
            os.environ[_NO_WEIGHTS_ONLY] = before


def import_torch():
    """Import mace-torch, then torch, and return the ``torch`` module.

    Returns:
      The ``torch`` module, with ``mace`` and ``mace.modules`` imported.

    Raises:
      ImportError: torch or mace-torch is not installed (the message says how
        to install them).
    """
    try:
        with _torch_load_default_kept(), warnings.catch_warnings():
            # mace must come before e3nn: e3nn's import torch.load's a
            # constants file (no weights_only argument) that torch's safe
            # default refuses; importing mace sets the environment variable
            # that lets it load, and e3nn then warns that the variable is set.
            # That warning is about the two libraries, not the user's input.
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
            import mace  # noqa: F401
            import mace.modules  # noqa: F401
            import torch
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return torch


def read_torch_model(path: str, *, trusted: bool = False):
    """``torch.load`` a mace-torch model file, with clear errors. The file is
    a pickle that can run code: refused unless ``trusted=True``."""
    if trusted is not True:
        raise UntrustedFileError(UNTRUSTED.format(path=path))
    torch = import_torch()
    if not os.path.exists(path):
        raise FileNotFoundError(f"No mace-torch model file at {path!r}.")
    try:
        with _torch_load_default_kept():  # unpickling may import more of mace
            obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds here
        raise ValueError(f"{path!r} is not a mace-torch model file: torch.load failed "
                         f"({type(e).__name__}: {e}). Expected a file written by "
                         f"torch.save(model) from mace-torch (e.g. MACE-MP '.model').") from e
    if isinstance(obj, dict):
        raise ValueError(f"{path!r} holds a state dict, not a mace-torch model: the "
                         f"architecture is not in it. Save the whole model "
                         f"(torch.save(model, path)) or use the original '.model' file.")
    if not isinstance(obj, torch.nn.Module) or not hasattr(obj, "interactions"):
        raise ValueError(f"{path!r} holds a {type(obj).__name__}, not a mace-torch MACE model.")
    return obj

"""Progress bars that are drawn only on a terminal.

Every long loop of chemtrain (epochs, steps, state points, converting files,
precomputing graphs) shows a tqdm bar through :func:`progress_bar`. When the
output is a file or a CI log, a bar's carriage-return redraws would become
hundreds of fragments, so there the bars are off and the one log line per
epoch is the progress.
"""
from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def interactive(stream=None) -> bool:
    """Whether progress bars are drawn: only on a terminal.

    Redirected to a file or a CI log, a bar's carriage-return redraws become
    hundreds of fragments; there the log line each epoch writes is the
    progress. ``CHEMTRAIN_PROGRESS=1`` draws bars anyway, ``=0`` never.

    Args:
      stream: the stream the bar writes to (default ``sys.stderr``, tqdm's).

    Returns:
      True where bars are drawn.
    """
    forced = os.environ.get("CHEMTRAIN_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def progress_bar(iterable=None, **kwargs):
    """A tqdm bar, disabled (but still iterating) when its stream (tqdm's
    ``file``, default standard error) is not a terminal."""
    if not interactive(kwargs.get("file")):
        kwargs["disable"] = True
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 0.5)
    return tqdm(iterable, **kwargs)

"""tqdm bars that stay quiet on non-root processes and in logs."""
from tqdm.auto import tqdm


def progress_bar(iterable=None, **kwargs):
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 0.5)
    return tqdm(iterable, **kwargs)

"""One checksum for every comparison of values across processes and files:
:func:`crc`, a CRC-32 of values taken one after another (state points,
trajectory files' ``state_kwargs``, replicas of parameters, HDF5 weights,
relative entropy's reference frames). Chained CRC-32 equals the CRC-32 of
the concatenated bytes, so a checksum can be extended piece by piece."""
from __future__ import annotations

import zlib

import numpy as np


def crc(*values, start: int = 0) -> int:
    """CRC-32 of ``values`` one after another, continuing from ``start``:
    a string by its UTF-8 bytes, bytes as they are, anything else as a
    C-ordered numpy array's bytes (dtype and shape are not included)."""
    for v in values:
        if isinstance(v, str):
            data = v.encode()
        elif isinstance(v, (bytes, bytearray)):
            data = bytes(v)
        else:
            data = np.ascontiguousarray(np.asarray(v)).tobytes()
        start = zlib.crc32(data, start)
    return start

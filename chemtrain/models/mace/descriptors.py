"""Irreps bookkeeping (e3nn-jax) and the cuequivariance descriptors of the
MACE model in :mod:`chemtrain.models.mace.model`: e3nn irreps from their
strings, cuequivariance's O3 with e3nn's irrep order and Clebsch-Gordan
coefficients, the segmented polynomials of the channel-wise tensor product
and of the symmetric contraction, and the default cuequivariance-jax
execution method.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import jax


def irreps(s: str):
    import e3nn_jax as e3nn
    return e3nn.Irreps(s)


@functools.lru_cache(None)
def _e3nn_o3():
    """cuequivariance's O3 with e3nn's irrep order and coupling coefficients."""
    import cuequivariance as cue
    import e3nn_jax as e3nn

    class O3e3nn(cue.O3):
        # e3nn orders irreps by (l, p) and couples them with its own real
        # Wigner 3j symbols; cue.O3 differs in both.
        def __mul__(a, b):
            return [O3e3nn(l=ir.l, p=ir.p) for ir in cue.O3.__mul__(a, b)]

        @classmethod
        def clebsch_gordan(cls, a, b, c):
            a, b, c = cls._from(a), cls._from(b), cls._from(c)
            if a.p * b.p != c.p:
                return np.zeros((0, a.dim, b.dim, c.dim))
            cg = np.asarray(e3nn.clebsch_gordan(a.l, b.l, c.l), dtype=np.float64)
            return cg[None] * np.sqrt(c.dim)

        def __lt__(a, b):
            b = a._from(b)
            return (a.l, a.p) < (b.l, b.p)

        @classmethod
        def iterator(cls):
            for l in itertools.count(0):
                yield O3e3nn(l=l, p=(-1) ** l)
                yield O3e3nn(l=l, p=-((-1) ** l))

    return O3e3nn


def cue_irreps(s: str):
    import cuequivariance as cue
    return cue.Irreps(_e3nn_o3(), str(irreps(s)))


@functools.lru_cache(None)
def conv_descriptor(edge_irreps: str, sh_irreps: str, target_irreps: str):
    """Channel-wise tensor product (weights per edge); output irreps sorted as
    mace-torch's ``tp_out_irreps_with_instructions`` sorts them."""
    import cuequivariance as cue
    target = [ir for _, ir in cue_irreps(target_irreps)]
    d = cue.descriptors.channelwise_tensor_product(
        cue_irreps(edge_irreps), cue_irreps(sh_irreps), target)
    return d.polynomial, _e3nn_irreps_string(d.outputs[0].irreps)


def _e3nn_irreps_string(cirreps) -> str:
    return "+".join(f"{mul}x{ir.l}{'e' if ir.p == 1 else 'o'}" for mul, ir in cirreps)


@functools.lru_cache(None)
def symmetric_descriptor(in_irreps: str, out_irreps: str, correlation: int):
    import cuequivariance as cue
    d = cue.descriptors.symmetric_contraction(
        cue_irreps(in_irreps), cue_irreps(out_irreps), tuple(range(1, correlation + 1)))
    return d.polynomial


def default_method() -> str:
    """cuequivariance-jax execution method: the CUDA kernel on a GPU when its
    package (cuequivariance-ops-jax-cu12/cu13) is installed, plain JAX
    elsewhere."""
    if jax.default_backend() != "gpu":
        return "naive"
    import importlib.util
    return "uniform_1d" if importlib.util.find_spec("cuequivariance_ops_jax") else "naive"

"""The configuration of a MACE model (:class:`MaceConfig`, with its
:class:`Layer` entries): a frozen value of plain numbers and strings that
says everything about an architecture (mace-torch's ``ScaleShiftMACE``
hyperparameters), with its JSON form and the per-head tables derived from
it. :mod:`chemtrain.models.mace.model` evaluates it and re-exports these."""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from chemtrain.models.species import element_table

RESIDUAL = "RealAgnosticResidualInteractionBlock"
DEFAULT_HEADS = ("Default",)   # mace-torch's name of a single-head model's head
PLAIN = "RealAgnosticInteractionBlock"
INTERACTIONS = (PLAIN, RESIDUAL)


@dataclasses.dataclass(frozen=True)
class Layer:
    """Irreps of one interaction + product layer (e3nn strings).

    A frozen dataclass, plain data (part of :class:`MaceConfig`'s JSON).

    Args:
      interaction: the mace-torch interaction block,
        ``"RealAgnosticResidualInteractionBlock"`` (with a skip connection from
        the input node features) or ``"RealAgnosticInteractionBlock"``.
      node_irreps: irreps of the input node features, e.g. ``"128x0e"``.
      edge_irreps: irreps after ``linear_up`` (the tensor product's node input).
      target_irreps: irreps of the tensor-product filter, the input of the
        symmetric contraction.
      hidden_irreps: irreps of the output of the product block (the next
        layer's ``node_irreps``).
      correlation: the highest degree (nu) of the symmetric contraction, >= 1.
      readout: ``"linear"`` or ``"nonlinear"`` (an MLP through
        :attr:`MaceConfig.mlp_irreps`).
    """
    interaction: str          # RESIDUAL or PLAIN
    node_irreps: str          # input node features
    edge_irreps: str          # after linear_up (tensor product input)
    target_irreps: str        # tensor-product filter / symmetric contraction input
    hidden_irreps: str        # output of the product block
    correlation: int
    readout: str              # "linear" or "nonlinear"


@dataclasses.dataclass(frozen=True)
class MaceConfig:
    """Everything of a MACE model but the trainable parameters; plain data (JSON).

    A frozen dataclass. Lengths are in Angstrom and energies in eV, as in
    mace-torch. :func:`chemtrain.models.mace.config_from_json` reads and checks
    the JSON of :meth:`to_json`.

    Args:
      atomic_numbers: atomic numbers of the elements the model knows, distinct
        and in increasing order; element index ``i`` of the model is
        ``atomic_numbers[i]``.
      r_max: cutoff radius in Angstrom.
      num_bessel: number of Bessel radial basis functions.
      num_polynomial_cutoff: exponent p of the polynomial cutoff envelope.
      max_ell: highest degree l of the spherical harmonics of edge directions.
      avg_num_neighbors: the messages summed on each atom are divided by this.
      radial_mlp: hidden widths of the radial MLP that maps the Bessel features
        to the tensor-product weights.
      layers: one :class:`Layer` per interaction; each layer's
        ``node_irreps`` are the previous layer's ``hidden_irreps``.
      mlp_irreps: irreps of the hidden layer of nonlinear readouts, per head
        (mace-torch's ``MLP_irreps``; a model of ``H`` heads has ``H`` times
        as many hidden features, head ``h`` reading only its own block).
      atomic_energies: E0s, the energy in eV of each element in the order of
        ``atomic_numbers``, added to each atom's energy. One tuple per head,
        ``((head 0's E0s), (head 1's E0s), ...)``, for a model of several
        heads; a flat tuple for a single head.
      scale: factor applied to each atom's interaction energy (the summed
        readouts of all layers plus the ZBL term); a tuple of one per head
        for several heads, a number for one.
      shift: added, in eV, to each atom's scaled interaction energy; per head
        as ``scale``.
      act_constant: e3nn's normalize2mom constant of SiLU (the factor of SiLU in
        the radial MLP and nonlinear readouts).
      distance_transform: None or ``"Agnesi"`` (Agnesi transform of the
        distance before the Bessel basis).
      agnesi: the Agnesi transform's ``(q, p, a)``.
      pair_repulsion: whether the ZBL pair repulsion is added.
      zbl: ZBL parameters ``(c0, c1, c2, c3, a_exp, a_prefactor)``.
      covalent_radii: covalent radii in Angstrom indexed by atomic number
        (used by the Agnesi transform and the ZBL repulsion).
      heads: names of the heads, distinct; default ``("Default",)``, what
        mace-torch calls the head of a single-head model. Every layer is shared;
        each head has its own readout output (one column of every readout),
        E0s, scale and shift. Head ``i`` is ``heads[i]`` (the ``head`` index of
        :func:`node_energies` and the energy function); mace-torch's
        multi-head fine-tuning puts the foundation model's head, ``"pt_head"``,
        first.
    """
    atomic_numbers: tuple[int, ...]
    r_max: float
    num_bessel: int
    num_polynomial_cutoff: int
    max_ell: int
    avg_num_neighbors: float
    radial_mlp: tuple[int, ...]
    layers: tuple[Layer, ...]
    mlp_irreps: str
    atomic_energies: tuple[float, ...] | tuple[tuple[float, ...], ...]  # eV per element (per head)
    scale: float | tuple[float, ...]
    shift: float | tuple[float, ...]
    act_constant: float                    # e3nn's normalize2mom constant of SiLU
    distance_transform: str | None = None  # None or "Agnesi"
    agnesi: tuple[float, float, float] = (0.9183, 4.5791, 1.0805)   # q, p, a
    pair_repulsion: bool = False
    zbl: tuple[float, ...] = (0.1818, 0.5099, 0.2802, 0.02817, 0.300, 0.4543)  # c0..c3, a_exp, a_prefactor
    covalent_radii: tuple[float, ...] = ()  # Angstrom, indexed by atomic number
    heads: tuple[str, ...] = DEFAULT_HEADS

    def to_json(self) -> str:
        """Serialize the configuration to a JSON string.

        Numpy scalars (e.g. atomic numbers taken from an array) are written as plain
        numbers, other objects JSON cannot hold as their ``str``. The ``heads``
        field is left out when it is the default ``("Default",)``, so that a
        single-head model's JSON is what chemtrain wrote before it knew heads.

        Returns:
          The JSON text of all fields (read back with :meth:`from_json` or, checked,
          :func:`chemtrain.models.mace.config_from_json`).
        """
        d = dataclasses.asdict(self)
        if tuple(self.heads) == DEFAULT_HEADS:
            del d["heads"]   # readable by chemtrain versions without heads
        # numpy scalars (e.g. atomic numbers taken from an array) as plain numbers
        return json.dumps(d, default=lambda x: x.item() if hasattr(x, "item") else str(x))

    @classmethod
    def from_json(cls, text: str) -> "MaceConfig":
        """Build a configuration from the JSON of :meth:`to_json`, unchecked.

        The values are not validated; for text from a file use
        :func:`chemtrain.models.mace.config_from_json`, which checks every field.

        Args:
          text: the JSON string.

        Returns:
          The :class:`MaceConfig`.

        Raises:
          json.JSONDecodeError: if ``text`` is not valid JSON.
          KeyError: if ``layers`` or a tuple-valued field (including ``agnesi``,
            ``zbl`` and ``covalent_radii``) is missing.
          TypeError: if a field is unknown or a required one is missing.
        """
        d = json.loads(text)
        d["layers"] = tuple(Layer(**layer) for layer in d["layers"])
        for key in ("atomic_numbers", "radial_mlp", "atomic_energies", "agnesi", "zbl", "covalent_radii"):
            d[key] = _tuples(d[key])
        for key in ("scale", "shift", "heads"):
            if key in d:
                d[key] = _tuples(d[key])
        return cls(**d)

    @property
    def num_elements(self) -> int:
        """Number of elements the model knows (``len(atomic_numbers)``)."""
        return len(self.atomic_numbers)

    @property
    def num_heads(self) -> int:
        """Number of heads (``len(heads)``)."""
        return len(self.heads)

    def head_index(self, head) -> int:
        """The index of a head given by name or index.

        Args:
          head: a head name (one of :attr:`heads`) or an integer index
            ``0 <= head < num_heads`` (negative indices count from the end).

        Returns:
          The index into :attr:`heads`.

        Raises:
          ValueError: naming the heads there are, for an unknown name or an
            index out of range.
        """
        if isinstance(head, str):
            if head not in self.heads:
                raise ValueError(f"The MACE model has no head {head!r}; its heads are "
                                 f"{list(self.heads)}.")
            return self.heads.index(head)
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)):
            raise ValueError(f"A head is a name or an integer index, got {head!r}; the heads are "
                             f"{list(self.heads)}.")
        if not -self.num_heads <= head < self.num_heads:
            raise ValueError(f"Head index {int(head)} is out of range: the MACE model has "
                             f"{self.num_heads} head(s) {list(self.heads)}.")
        return int(head) % self.num_heads

    def atomic_energies_per_head(self) -> np.ndarray:
        """The E0s as a float64 array (num_heads, num_elements), one row per head.

        Raises:
          ValueError: if ``atomic_energies`` is not laid out for the heads (a
            flat tuple for one head, one tuple per head for several).
        """
        e0 = np.asarray(self.atomic_energies, np.float64)
        e0 = e0[None] if self.num_heads == 1 and e0.ndim == 1 else e0
        if e0.shape != (self.num_heads, self.num_elements):
            raise ValueError(f"atomic_energies of shape {e0.shape} do not fit {self.num_heads} "
                             f"head(s) {list(self.heads)} and {self.num_elements} elements: give "
                             f"one tuple of E0s per head (a flat tuple for one head).")
        return e0

    def scale_shift_per_head(self) -> tuple[np.ndarray, np.ndarray]:
        """Scale and shift as two float64 arrays (num_heads,), one entry per head.

        Raises:
          ValueError: if ``scale`` or ``shift`` is not laid out for the heads (a
            number for one head, a tuple of one per head for several).
        """
        out = []
        for key in ("scale", "shift"):
            x = np.asarray(getattr(self, key), np.float64)
            if x.shape != (() if self.num_heads == 1 else (self.num_heads,)):
                raise ValueError(f"{key} of shape {x.shape} does not fit {self.num_heads} head(s) "
                                 f"{list(self.heads)}: give a number for one head, a tuple of one "
                                 f"per head for several.")
            out.append(x.reshape(self.num_heads))
        return tuple(out)

    def element_table(self) -> np.ndarray:
        """(119,) int32: the index of each atomic number in ``atomic_numbers``,
        -1 where the model does not know it (:func:`chemtrain.models.species.element_table`)."""
        return element_table(self.atomic_numbers)


def _tuples(x):
    """JSON lists (nested) as tuples."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x

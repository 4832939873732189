"""Neighbors: who interacts with whom, decided in one place.

Two ways for an energy function to get its edges:

- **Precomputed graphs** (:class:`Graph`) for structures that do not move
  during training: every edge, periodic images included, found once on the
  host (matscipy when installed, else ASE) by :func:`precompute_graphs` or
  :func:`add_graphs` and stored with the data as ``senders``, ``receivers``
  (structures, edges) and ``shifts`` (structures, edges, 3). ``shifts`` are
  integer counts of cell vectors: the edge vector from sender ``s`` to
  receiver ``r`` is ``R[r] - R[s] + box @ shift`` (``box`` in jax-md's
  layout, the columns are the cell vectors). Padded edges point at the
  sentinel index N (the number of atoms). Cells of any size and shape work,
  partly periodic ones (slabs) too.
- **jax-md neighbor lists** for moving atoms, from :func:`neighbor_list`,
  which chooses the settings (format, capacity, cell list on or off, free
  space or periodic) in one place. jax-md finds one periodic image per pair
  (the minimum image), which is wrong when a cell is narrower than twice
  the cutoff: :func:`check_minimum_image` refuses such cells with an error
  naming their perpendicular widths and the cutoff.

:func:`edge_vectors` turns either kind into ``(senders, receivers, vectors,
real)`` with vectors pointing from sender to receiver (mace-torch's
convention), applying jax-md's ``perturbation`` (the strain whose derivative
is the stress) in both cases. Lengths are in whatever unit the positions
are (nm inside chemtrain).
"""
from .edges import (GRAPH_KEYS, Graph, SmallCellError, check_minimum_image, disjoint_edges,
                    edge_vectors, graph_from, mask_graph, neighbor_pairs, pair_weight,
                    perpendicular_widths)
from .host import add_graphs, host_edges, pad_edges, precompute_graphs
from .lists import (fixed_neighbor_list, list_box, list_cutoff, list_is_periodic, make_space,
                    neighbor_list)

__all__ = ["GRAPH_KEYS", "Graph", "SmallCellError", "add_graphs", "check_minimum_image",
           "disjoint_edges", "edge_vectors", "fixed_neighbor_list", "graph_from", "host_edges",
           "list_box", "list_cutoff", "list_is_periodic", "make_space", "mask_graph",
           "neighbor_list", "neighbor_pairs", "pad_edges", "pair_weight", "perpendicular_widths",
           "precompute_graphs"]

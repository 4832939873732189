"""Names of the arrays of chemtrain's datasets that more than one layer
reads (no imports: every layer may use it)."""

#: the arrays of a precomputed graph (edges found on the host, periodic images included)
GRAPH_KEYS = ("senders", "receivers", "shifts")

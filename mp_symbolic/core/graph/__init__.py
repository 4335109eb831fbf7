"""The network as a graph: the typed placed graph, its passes, the loss heads,
the cut into stages."""

"""Packing core: bin packing of sample lengths, the packed-batch contract (segment ids -> ``cu_seqlens``,
positions, shifted labels, loss mask), cost-balanced plans, the context-parallel zigzag layout and the
dynamic CP plan (each sample on the smallest CP group that holds it).

The ground floor beside ``runtime``: pure algorithms over lengths and tensors, importing nothing of
mindspeed_pack but the compiled ``_helpers``.
"""

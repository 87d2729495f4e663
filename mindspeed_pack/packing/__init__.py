"""Packing core: bin packing of sample lengths and the packed-batch contract."""

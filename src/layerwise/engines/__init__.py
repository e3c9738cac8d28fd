"""Extraction engines beyond one process: :mod:`layerwise.engines.ray` (Ray) runs the parts of a sharded extraction
on a cluster and merges them; the local engine is :mod:`layerwise.engine`."""

"""Extraction: a corpus through a model into a feature store, resumable, on one machine or a cluster.

=================  ===========================================================================================
module             concept
=================  ===========================================================================================
``options``        :class:`ExtractOptions` (how a run goes: shards, strictness, overwrite, sharding of the input)
``shards``         one shard's rows: records -> the tensors of the store layout
``engine``         the local engine: :func:`extract` (validate, open the store, the record loop, finish)
``ray``            the same stages on a Ray cluster (:func:`layerwise.ray.extract`); needs ``layerwise[ray]``
``cluster``        the Ray cluster of a run: connected to, or started locally and ended with the run
``guard``          the process that ends a driver's own Ray cluster when the driver dies (``kill -9`` included)
``stall``          the stall watchdog of a Ray run and the stages' progress marks
``pool``           the encode pool sized from the cluster's resources
``input_check``    a run's input checked as it is read
=================  ===========================================================================================

Engine-free sharding (``ExtractOptions(num_shards=, shard_index=)``) runs parts of the local engine under any
scheduler; :func:`layerwise.store.merge_stores` joins them.
"""

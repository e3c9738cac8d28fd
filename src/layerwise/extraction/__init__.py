"""Extraction: a corpus through a model into a feature store, resumable, on one machine or a cluster.

=================  ===========================================================================================
module             concept
=================  ===========================================================================================
``options``        :class:`ExtractOptions` (how a run goes: shards, strictness, overwrite, sharding of the input)
``shards``         one shard's rows: records -> the tensors of the store layout
``engine``         the local engine: :func:`extract` (validate, open the store, the record loop, finish)
``ray``            the same stages on a Ray cluster (:func:`layerwise.ray.extract`); needs ``layerwise[ray]``
=================  ===========================================================================================

Engine-free sharding (``ExtractOptions(num_shards=, shard_index=)``) runs parts of the local engine under any
scheduler; :func:`layerwise.store.merge_stores` joins them.
"""

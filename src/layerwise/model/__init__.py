"""A model and where its layers are: options, loading, layer maps, capture, and the runtimes behind it.

=================  ===========================================================================================
module             concept
=================  ===========================================================================================
``options``        :class:`ModelOptions`, the one way a model is named and loaded (JSON round trip)
``loaded``         :class:`LoadedModel`: the model, its tokenizer and the facts layerwise needs about it
``loading``        loading a transformers model and tokenizer (the embedded default, safety switches)
``families``       the hand-checked table of the seven BERT families
``discovery``      finding and verifying the layers of any other architecture
``layermap``       :class:`LayerMap`: where one loaded model's layers and sites are
``positions``      how long an input each architecture takes
``custom``         any PyTorch module whose layer list is named (``Extractor.from_module``)
``capture``        scoped forward hooks with early exit
``hardware``       what this CPU computes fast
``describe``       the one description of a loaded model (service, manifest, ``inspect``)
``backends/``      the runtimes (torch, auto, onnx, keras, tf) behind one interface
=================  ===========================================================================================
"""

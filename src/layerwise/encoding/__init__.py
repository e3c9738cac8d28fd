"""What to compute and how: the steps between text and features, independent of any model runtime.

=================  ===========================================================================================
module             concept
=================  ===========================================================================================
``vocab``          the vocabularies (levels, sites, combine modes, pools, output dtypes); imports no torch
``layers``         layer specs (index 0 = embeddings) and site names: parse, resolve, validate
``spec``           :class:`EncodeSpec`, the one description of a computation (JSON round trip); imports no torch
``tokenize``       fast-tokenizer calls: ids, offsets, word ids, special tokens, input checks
``windows``        strided windows for long inputs, token-budget batches, the windowed forward pass, stitching
``padding``        ragged rows to a padded batch and its mask
``combine``        layers -> one tensor (concat, sum, mean, weighted, stack; ScalarMix, LayerAttention)
``pooling``        tokens -> a sentence vector, sub-tokens -> a word vector (masks honoured)
``reduce``         one record's result from combined states (:class:`Encoded`)
``precision``      the last step: leading ``dimensions``, L2 norm, ``output_dtype`` (float16, int8/uint8 with
                   calibration ranges, binary/ubinary packed bits); imports no torch at module level
``stack``          :class:`LayerStack`, raw states as a typed object
=================  ===========================================================================================
"""

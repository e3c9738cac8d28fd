"""A chosen layer as a model every other tool loads: the source cut after layer ``K``, written as a standard Hugging
Face directory that is also a sentence-transformers model, and checked against layerwise before it is reported.

==============================  ==================================================================================
module                          one concept
==============================  ==================================================================================
``plan.py``                     what an export writes (``ExportPlan``), or the refusal naming what can be
                                exported instead; no torch
``checkpoint.py``               the model cut after layer ``K`` (config and layer list) and written with its
                                tokenizer, in the narrowest exact dtype
``st_modules.py``               the sentence-transformers files (``modules.json``, pooling, a layer mix,
                                normalize, the prompt)
``verify.py``                   the check: the directory loaded by transformers and by sentence-transformers
                                against layerwise on a fixed probe set
``export.py``                   ``export_model``: the steps in order, the output's rules, ``layerwise-export.json``
==============================  ==================================================================================
"""

from __future__ import annotations

from .export import ExportResult, export_model

__all__ = ["ExportResult", "export_model"]

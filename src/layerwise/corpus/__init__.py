"""Input records from the formats users bring: text, JSONL, CSV/TSV, parquet, CoNLL-2003, CoNLL-U, stdin, and
tables in memory (Hugging Face datasets, pyarrow).

=================  ===========================================================================================
module             concept
=================  ===========================================================================================
``records``        :class:`Record` and :class:`BadRecord`: one input record, or why one could not be read
``readers``        reading each file format line by line (:class:`ReadOptions`)
``conll``          CoNLL-2003 and CoNLL-U sentences and documents
``sources``        :class:`Source`: one input (file, stdin, parquet directory, table) and its content identity
=================  ===========================================================================================
"""

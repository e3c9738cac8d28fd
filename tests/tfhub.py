"""TensorFlow fixtures written at test time: a keras-hub preset and a SavedModel in the TF Hub BERT interface.

Both are made from a local Hugging Face BERT directory (the tiny random BERT, or the embedded all-MiniLM-L6-v2),
offline: keras-hub converts the checkpoint, and the SavedModel wraps the converted backbone in a ``tf.Module``
whose ``__call__`` takes ``{input_word_ids, input_mask, input_type_ids}`` and returns ``pooled_output``,
``sequence_output`` and ``encoder_outputs`` (one tensor per layer, embeddings not included), as TF Hub's BERT
encoders do. Its vocabulary goes to ``assets/vocab.txt``, where TF Hub models keep it.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path


def write_vocab(hf_dir: Path, dest: Path) -> Path:
    """The WordPiece vocabulary of ``hf_dir`` as a ``vocab.txt`` at ``dest`` (one token a line, in id order)."""
    from transformers import AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    if (hf_dir / "vocab.txt").is_file():
        shutil.copy(hf_dir / "vocab.txt", dest)
    else:
        vocab = AutoTokenizer.from_pretrained(str(hf_dir)).get_vocab()
        dest.write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])), encoding="utf-8")
    return dest


def keras_preset(hf_dir: Path, out: Path) -> Path:
    """A keras-hub preset directory (backbone + tokenizer assets) converted from ``hf_dir``."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone.from_preset(str(hf_dir))
    with warnings.catch_warnings():  # keras' h5 writer trips numpy 2's __array__(copy=) deprecation notice
        warnings.simplefilter("ignore", DeprecationWarning)
        backbone.save_to_preset(str(out))
    vocab = write_vocab(hf_dir, out.parent / f"{out.name}-vocab.txt")
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=str(vocab), lowercase=True)
    tokenizer.save_to_preset(str(out))
    return out


def tfhub_saved_model(hf_dir: Path, out: Path, *, embeddings: bool = False) -> Path:
    """A SavedModel with the TF Hub BERT signature, built from ``hf_dir`` (``embeddings``: also return layer 0)."""
    import keras
    import keras_hub
    import tensorflow as tf

    from layerwise.model.backends.keras import block_layers, use_exact_gelu

    backbone = keras_hub.models.BertBackbone.from_preset(str(hf_dir))
    blocks = block_layers(backbone)
    use_exact_gelu(blocks)  # the checkpoint's own (exact) GELU, as transformers computes it
    first = blocks[0].input[0] if isinstance(blocks[0].input, (list, tuple)) else blocks[0].input
    outputs = {"sequence_output": backbone.output["sequence_output"], "pooled_output": backbone.output["pooled_output"],
               "encoder_outputs": [b.output for b in blocks]}
    if embeddings:
        outputs["embedding_output"] = first
    graph = keras.Model(backbone.inputs, outputs)
    spec = {name: tf.TensorSpec([None, None], tf.int32, name=name)
            for name in ("input_word_ids", "input_mask", "input_type_ids")}

    class Encoder(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.graph = graph
            self.do_lower_case = tf.Variable(True, trainable=False)

        @tf.function(input_signature=[spec])
        def __call__(self, inputs):
            return self.graph({"token_ids": inputs["input_word_ids"], "padding_mask": inputs["input_mask"],
                               "segment_ids": inputs["input_type_ids"]}, training=False)

    tf.saved_model.save(Encoder(), str(out))
    write_vocab(hf_dir, out / "assets" / "vocab.txt")
    return out

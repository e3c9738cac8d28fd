"""``Extractor``: the one high-level entry point (tokenise -> batch -> capture -> combine -> pool).

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor()                                   # embedded all-MiniLM-L6-v2, CPU, float32
    >>> ex.encode(["I love Paris", "EU rejects German call"], layers="-4:", combine="concat", pool="max").shape
    (2, 1536)
    >>> [w.shape for w in ex.encode_words([["EU", "rejects", "German", "call"]], layers="-4:", combine="concat")]
    [(4, 1536)]
    >>> ex.hidden_states(["I love Paris"], layers="all").tensor.shape     # [layers, batch, tokens, hidden]
    torch.Size([7, 1, 5, 384])

Pitfalls handled for you: layer 0 is the embeddings; padding never enters a pool; long texts are windowed,
not truncated (pass ``truncate=True`` to cut them at the model's maximum instead); results do not depend on
batch size, order or length sorting; only the layers asked for are computed and kept.
"""

from __future__ import annotations

import os
from typing import Iterator, Literal, Sequence

import torch
from torch import nn

from .capture import capture
from .combine import combine as combine_layers
from .combine import validate_combine
from .layers import LayerSpec, resolve_layers, validate_site
from .onnx_backend import OnnxRunner, check_backend
from .loading import LoadedModel, load_model
from .pooling import validate_pool, validate_word_pool
from .stack import LayerStack
from .pipeline import _check_texts, _Group, forward_windows, sentence_reducer, word_reducer
from .tokenize import Tokenized, special_template, tokenize

ReturnTensors = Literal["np", "pt"]
CPU_BATCH_TOKENS = 1024  # measured best on CPU (cache-resident activations); see benchmarks/README.md
GPU_BATCH_TOKENS = 16384
_CHUNK_TEXTS = 4096  # texts tokenised and length-sorted together; bounds memory on large corpora


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int (tokens), got {value!r}")
    return value


class Extractor:
    """Hidden layers of a BERT-family encoder as features.

    Args:
        model: local model directory or hub id; ``None`` = embedded all-MiniLM-L6-v2. A
            :class:`~layerwise.loading.LoadedModel` is used as is.
        device: ``"cpu"``, ``"cuda"``...; ``None`` = CUDA when available, else CPU.
        dtype: ``"float32"`` (default), ``"float16"``/``"bfloat16"`` (CUDA; slow on most CPUs).
        batch_tokens: token budget per forward batch (``rows * longest row``); default 1024 on CPU (activations stay
            in cache: 1.45x faster than 8192 on a 2-core CPU, see benchmarks/README.md) and 16384 on CUDA.
        max_length: window length in tokens (special tokens included); default and maximum: the model's.
        stride: overlap in tokens between consecutive windows of a long text; default ``max_length // 4``.
        sort_by_length: sort rows by length before batching (faster; results are identical either way).
        revision, allow_pickle, trust_remote_code: see :func:`layerwise.loading.load_model` (both flags are
            opt-in because they run code from the checkpoint).
        backend: ``torch`` (default) or ``onnx`` (ONNX Runtime on CPU, block site; the graph is exported once per
            layer choice and cached under ``onnx_cache``, default ``~/.cache/layerwise/onnx``).
    """

    def __init__(
        self,
        model: str | os.PathLike | LoadedModel | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_tokens: int | None = None,
        max_length: int | None = None,
        stride: int | None = None,
        sort_by_length: bool = True,
        revision: str | None = None,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        backend: str = "torch",
        onnx_cache: str | os.PathLike | None = None,
    ):
        self.backend = check_backend(backend)
        self.loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model,
                device=device,
                dtype=dtype,
                revision=revision,
                allow_pickle=allow_pickle,
                trust_remote_code=trust_remote_code,
            )
        )
        limit = self.loaded.max_length
        self.max_length = limit if max_length is None else _int(max_length, "max_length")
        self._template = special_template(self.loaded.tokenizer)
        n_special = sum(self._template)
        if not n_special < self.max_length <= limit:
            raise ValueError(
                f"max_length={max_length} is outside {n_special + 1}..{limit} (this model's maximum, special tokens "
                f"included)"
            )
        capacity = self.max_length - n_special
        self.stride = capacity // 4 if stride is None else _int(stride, "stride")
        if not 0 <= self.stride < capacity:
            raise ValueError(f"stride={stride} must be in 0..{capacity - 1} (window capacity {capacity} tokens)")
        if batch_tokens is None:
            batch_tokens = CPU_BATCH_TOKENS if self.loaded.device.type == "cpu" else GPU_BATCH_TOKENS
        self.batch_tokens = self._check_budget(batch_tokens)
        self.sort_by_length = bool(sort_by_length)
        self._onnx = None
        if self.backend == "onnx":
            if self.loaded.device.type != "cpu":
                raise ValueError("backend='onnx' runs on the CPU here; use backend='torch' for CUDA")
            self._onnx = OnnxRunner(self.loaded, onnx_cache)

    # ---- facts ----------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def num_layers(self) -> int:
        """``L``: valid layer indices are ``0..L`` (0 = embeddings)."""
        return self.loaded.num_layers

    @property
    def hidden_size(self) -> int:
        return self.loaded.hidden_size

    def __repr__(self) -> str:
        lm = self.loaded
        return (
            f"Extractor(model={lm.name!r}, family={lm.family.name}, layers=0..{lm.num_layers}, hidden={lm.hidden_size}, "
            f"device={lm.device}, dtype={str(lm.dtype).replace('torch.', '')})"
        )

    @staticmethod
    def _check_budget(batch_tokens: object) -> int:
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise ValueError(f"batch_tokens must be a positive int (tokens per batch), got {batch_tokens!r}")
        return batch_tokens

    def _pooler(self):
        fn = self.loaded.family.pooler
        return fn(self.loaded.model) if fn is not None else None

    # ---- the pipeline -----------------------------------------------------------------------------------
    def _tokenize(self, items: list, words: bool, truncate: bool) -> list[Tokenized]:
        toks = tokenize(self.loaded.tokenizer, items, words=words, template=self._template)
        if truncate:
            cap = self.max_length - sum(self._template)
            for t in toks:
                if t.n_content > cap:
                    keep = list(range(t.n_prefix + cap)) + list(range(len(t.ids) - t.n_suffix, len(t.ids)))
                    t.ids, t.offsets = [t.ids[i] for i in keep], [t.offsets[i] for i in keep]
                    t.word_ids, t.special = [t.word_ids[i] for i in keep], [t.special[i] for i in keep]
        return toks

    def _forward(
        self, toks: list[Tokenized], layers: tuple[int, ...], site: str, batch_tokens: int
    ) -> Iterator[_Group]:
        """Run every window of ``toks``; yield groups of finished texts (see :func:`forward_windows`)."""
        if self._onnx is not None:
            run = lambda ids, mask: self._onnx.run(ids, mask, layers)  # noqa: E731
        else:
            run = lambda ids, mask: capture(self.loaded, ids, mask, layers, site)  # noqa: E731
        yield from forward_windows(toks, run, max_length=self.max_length, stride=self.stride, batch_tokens=batch_tokens,
                                   pad_id=self.loaded.tokenizer.pad_token_id or 0, sort=self.sort_by_length)

    def _prepare(
        self, layers: LayerSpec, site: str, combine=None, weights=None, return_tensors: str = "np"
    ) -> tuple[tuple[int, ...], str]:
        if return_tensors not in ("np", "pt"):
            raise ValueError(f"unknown return_tensors {return_tensors!r}. Valid values are: np, pt")
        if isinstance(combine, nn.Module) and getattr(combine, "layers", None) is not None and layers is None:
            layers = combine.layers
        resolved = resolve_layers(-1 if layers is None else layers, self.num_layers)
        validate_site(site, resolved)
        check_backend(self.backend, site)
        if combine is not None:
            validate_combine(combine, len(resolved), weights)
        return resolved, site

    def _progress(self, total: int, show: bool, unit: str = "text"):
        from tqdm.auto import tqdm

        return tqdm(total=total, disable=not show, unit=unit, desc="layerwise", leave=False)

    def _masks(self, toks: list[Tokenized], group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        T = group.states.shape[2]
        mask = torch.zeros((len(group.texts), T), dtype=torch.long)
        special = torch.ones((len(group.texts), T), dtype=torch.bool)
        for r, (text, n) in enumerate(zip(group.texts, group.lengths)):
            mask[r, :n] = 1
            special[r, :n] = torch.tensor(toks[text].special[:n], dtype=torch.bool)
        dev = group.states.device
        return mask.to(dev), special.to(dev)

    # ---- public API -------------------------------------------------------------------------------------
    def hidden_states(
        self,
        texts: Sequence[str],
        layers: LayerSpec = "all",
        site: str = "block",
        *,
        truncate: bool = False,
        batch_tokens: int | None = None,
    ) -> LayerStack:
        """Raw hidden states of ``layers`` at ``site`` for a (small) batch of texts.

        Args:
            texts: list of strings (an empty string encodes as the special tokens only).
            layers: layer spec (``"all"``, ``-1``, ``"-4:"``, ``[0, 6]``, ``"second_to_last"``...).
            site: ``block`` (= ``hidden_states``), ``attention``, ``intermediate`` or ``pre_ln``.
            truncate: cut texts at ``max_length`` instead of windowing them.
            batch_tokens: token budget per forward batch (default: the Extractor's).

        Returns:
            :class:`LayerStack` with ``tensor [layers, batch, tokens, width]`` on CPU, padded with zeros to the
            longest text (``tokens`` may exceed ``max_length`` for windowed texts).
        """
        texts = _check_texts(texts)
        resolved, site = self._prepare(layers, site)
        budget = self._check_budget(self.batch_tokens if batch_tokens is None else batch_tokens)
        toks = self._tokenize(texts, words=False, truncate=truncate)
        longest = max(len(t.ids) for t in toks)
        width = self.loaded.site_width(site)
        out = torch.zeros((len(resolved), len(texts), longest, width), dtype=self.loaded.dtype)
        for group in self._forward(toks, resolved, site, budget):
            for r, (text, n) in enumerate(zip(group.texts, group.lengths)):
                out[:, text, :n] = group.states[:, r, :n].cpu()
        return LayerStack.from_tokens(out, resolved, site, toks, self.loaded.tokenizer.pad_token_id or 0, self.num_layers)

    def encode(
        self,
        texts: Sequence[str],
        layers: LayerSpec | None = None,
        combine: str | nn.Module = "concat",
        pool: str | nn.Module | None = "mean",
        *,
        site: str = "block",
        weights: Sequence[float] | None = None,
        skip_special_tokens: bool = False,
        truncate: bool = False,
        return_tensors: ReturnTensors = "np",
        batch_tokens: int | None = None,
        show_progress: bool = False,
    ):
        """Sentence vectors (or token vectors with ``pool=None``) from a combination of layers.

        Args:
            texts: list of strings.
            layers: layer spec; default ``-1`` (the last layer), or the layers a ScalarMix was built ``over``.
            combine: ``concat | sum | mean | weighted | stack`` or a module such as :class:`ScalarMix`.
            pool: ``cls | pooler | mean | max | mean_max | last``, a module such as :class:`AttentionPool`,
                or ``None`` for one vector per token (special tokens included).
            site: ``block | attention | intermediate | pre_ln``.
            weights: fixed per-layer weights for ``combine="weighted"``.
            skip_special_tokens: leave ``[CLS]``/``[SEP]``-like tokens out of the pool.
            truncate: cut texts at ``max_length`` instead of windowing them.
            return_tensors: ``"np"`` (float32 numpy) or ``"pt"`` (CPU torch tensors in the model dtype).
            batch_tokens: token budget per forward batch (default: the Extractor's).
            show_progress: show a progress bar.

        Returns:
            ``[n_texts, D]`` (``stack``: ``[n_texts, K, width]``) or, with ``pool=None``, a list of
            ``[n_tokens_i, D]``. ``D = K * width`` for ``concat``, ``width`` otherwise, doubled for ``mean_max``.
        """
        texts = _check_texts(texts)
        resolved, site = self._prepare(layers, site, combine, weights, return_tensors)
        self._check_pool_fits(pool, combine, resolved, site, skip_special_tokens)
        budget = self._check_budget(self.batch_tokens if batch_tokens is None else batch_tokens)
        results: list = [None] * len(texts)
        with self._progress(len(texts), show_progress) as bar:
            stream = self._stream(
                texts, words=False, layers=resolved, site=site, combine=combine, weights=weights,
                reduce=self._sentence_reducer(pool, skip_special_tokens), truncate=truncate, batch_tokens=budget,
            )
            for index, vec, _ in stream:
                results[index] = vec.cpu()
                bar.update(1)
        if pool is None:
            return [self._out(v, return_tensors) for v in results]
        return self._out(torch.stack(results), return_tensors)

    def encode_words(
        self,
        words: Sequence[Sequence[str]],
        layers: LayerSpec | None = None,
        combine: str | nn.Module = "concat",
        subword: str = "first",
        *,
        site: str = "block",
        weights: Sequence[float] | None = None,
        truncate: bool = False,
        return_tensors: ReturnTensors = "np",
        batch_tokens: int | None = None,
        show_progress: bool = False,
    ) -> list:
        """One vector per word of pre-tokenised input (NER/POS style), pooled from its sub-tokens.

        Args:
            words: list of word lists, e.g. ``[["EU", "rejects", "German", "call"]]``.
            layers, combine, site, weights: as in :meth:`encode`.
            subword: ``first | last | mean | max | first_last`` (the BERT paper uses ``first``).
            truncate: cut at ``max_length`` instead of windowing (words past the cut get zero vectors).

        Returns:
            A list with one ``[n_words_i, D]`` array (or tensor) per item, aligned to its words. A word that
            produced no sub-token (e.g. only a zero-width character) gets a zero vector.
        """
        words = _check_texts(words, words=True)
        resolved, site = self._prepare(layers, site, combine, weights, return_tensors)
        self._check_subword(subword, combine)
        budget = self._check_budget(self.batch_tokens if batch_tokens is None else batch_tokens)
        results: list = [None] * len(words)
        with self._progress(len(words), show_progress) as bar:
            stream = self._stream(
                [list(w) for w in words], words=True, layers=resolved, site=site, combine=combine, weights=weights,
                reduce=self._word_reducer(subword), truncate=truncate, batch_tokens=budget,
            )
            for index, vec, _ in stream:
                results[index] = vec.cpu()
                bar.update(1)
        return [self._out(v, return_tensors) for v in results]

    # ---- streaming core (also used by the feature store) -------------------------------------------------
    def _sentence_reducer(self, pool, skip_special_tokens: bool):
        """A reducer for :meth:`_stream`: the sentence pool ``pool`` (token vectors for ``None``)."""
        return sentence_reducer(pool, skip_special_tokens, self._pooler() if pool == "pooler" else None)

    _word_reducer = staticmethod(word_reducer)

    @staticmethod
    def _check_subword(subword: object, combine) -> None:
        validate_word_pool(subword)
        if combine == "stack" and subword == "first_last":
            raise ValueError("subword='first_last' concatenates features; use it with a combine mode other than 'stack'")

    def _stream(
        self,
        items: list,
        *,
        words: bool,
        layers: tuple[int, ...],
        site: str,
        combine,
        weights,
        reduce,
        truncate: bool,
        batch_tokens: int,
    ) -> Iterator[tuple[int, torch.Tensor, Tokenized]]:
        """Yield ``(index, vector, tokenized)`` for every item, in completion order (not input order).

        Items are tokenised and length-sorted ``_CHUNK_TEXTS`` at a time, so memory stays bounded. ``vector`` is
        whatever ``reduce`` makes of the row (on the model's device); arguments are already validated.
        """
        for start in range(0, len(items), _CHUNK_TEXTS):
            chunk = items[start : start + _CHUNK_TEXTS]
            toks = self._tokenize(chunk, words=words, truncate=truncate)
            for t, item in zip(toks, chunk):
                t.n_words = len(item) if words else 0
            for group in self._forward(toks, layers, site, batch_tokens):
                mask, special = self._masks(toks, group)
                rows = [toks[i] for i in group.texts]  # group.lengths[r] == len(rows[r].ids)
                with torch.inference_mode():
                    x = combine_layers(group.states, combine, weights=weights, mask=mask)
                    vecs = reduce(x, mask, special, rows)
                for r, i in enumerate(group.texts):
                    yield start + i, vecs[r], toks[i]

    # ---- helpers ----------------------------------------------------------------------------------------
    def _check_pool_fits(self, pool, combine, layers, site, skip_special_tokens) -> None:
        if pool is None:
            return
        validate_pool(pool, skip_special_tokens=skip_special_tokens, has_pooler=self._pooler() is not None)
        if pool == "pooler":
            widens = combine == "stack" or (combine == "concat" and len(layers) > 1) or site == "intermediate"
            if widens:
                raise ValueError(
                    "pool='pooler' applies the model's pooler, which takes hidden_size features; use one layer, or "
                    "combine='sum'|'mean'|'weighted' or a ScalarMix, at site 'block'/'attention'/'pre_ln'"
                )

    @staticmethod
    def _out(t: torch.Tensor, return_tensors: str):
        return t if return_tensors == "pt" else t.float().numpy()

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

Every call is an :class:`~layerwise.EncodeSpec` run through :meth:`Extractor.stream`; ``encode`` and
``encode_words`` are thin wrappers that build the spec from keyword arguments.

Pitfalls handled for you: layer 0 is the embeddings; padding never enters a pool; long texts are windowed,
not truncated (pass ``truncate=True`` to cut them at the model's maximum instead); results do not depend on
batch size, order or length sorting; only the layers asked for are computed and kept.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import numpy as np
import torch
from torch import nn

from .encoding.layers import LayerSpec
from .encoding.precision import NUMPY_DTYPES, Ranges
from .encoding.reduce import Encoded, make_rows
from .encoding.spec import EncodeSpec
from .encoding.stack import LayerStack
from .encoding.tokenize import TextTokenizer, Tokenized, check_texts, special_template
from .encoding.windows import Group, forward_windows
from .errors import ModelLoadError, SpecError
from .model.backends import Backend, create_backend, load_backend
from .model.backends.base import Plan
from .model.describe import describe
from .model.loaded import LoadedModel
from .model.options import ModelOptions
from .model.positions import UNLIMITED
from .notices import notice

ReturnTensors = Literal["np", "pt"]
RETURN_TENSORS = ("np", "pt")
CPU_BATCH_TOKENS = 1024  # measured best on CPU (cache-resident activations); see benchmarks/README.md
GPU_BATCH_TOKENS = 16384
CHUNK_RECORDS = 4096  # records tokenised and length-sorted together; bounds memory on large corpora


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name} must be an int (tokens), got {value!r}")
    return value


def check_budget(batch_tokens: object) -> int:
    """A token budget per forward batch: a positive int, else ``ValueError`` naming the value."""
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise SpecError(f"batch_tokens must be a positive int (tokens per batch), got {batch_tokens!r}")
    return batch_tokens


class Extractor:
    """Hidden layers of a transformer (any architecture ``AutoModel`` loads, or any module) as features.

    Args:
        model: a :class:`~layerwise.ModelOptions`, or its ``model`` field: a local model directory or hub id
            (``None``: the embedded all-MiniLM-L6-v2). A :class:`~layerwise.LoadedModel` or a
            :class:`~layerwise.model.backends.Backend` is used as is.
        batch_tokens: token budget per forward batch (``rows * longest row``); default 1024 on CPU (activations stay
            in cache: 1.45x faster than 8192 on a 2-core CPU, see benchmarks/README.md) and 16384 on CUDA.
        sort_by_length: sort rows by length before batching (faster; results are identical either way).
        options: the other :class:`~layerwise.ModelOptions` fields (every valid value is in its docstring):

            * ``device``: ``"cpu"``, ``"cuda"``...; ``None`` = CUDA when available, else CPU.
            * ``compute_dtype``: how the model runs: ``"float32"`` (default), ``"float16"``/``"bfloat16"``: on
              CUDA, or on a CPU with native support (bfloat16: AVX-512 BF16 or AMX; about 2.4x float32 there);
              elsewhere a PrecisionWarning says it is slow. (Features come back in the spec's ``output_dtype``.)
            * ``max_length``: window length in tokens (special tokens included); default: the model's
              ``sentence_bert_config.json`` ``max_seq_length`` when present (256 for the embedded all-MiniLM-L6-v2,
              the length it was trained at), else the model's maximum; maximum: the model's position limit.
            * ``stride``: overlap in tokens between consecutive windows of a long text; default ``max_length // 4``.
            * ``backend``: ``auto`` (the default for transformers models: ONNX Runtime for the block site wherever
              its states equal PyTorch's within 1e-5, checked once per depth, else PyTorch; see
              :mod:`layerwise.model.backends.auto`), ``torch``, ``onnx`` (ONNX Runtime on CPU, block site, the BERT
              families), ``keras`` (a keras-hub backbone: a preset directory, or a Hugging Face directory converted
              on load) or ``tf`` (a TF Hub BERT SavedModel); a keras-hub preset directory defaults to ``keras``, a
              SavedModel to ``tf``. ``keras`` and ``tf`` need ``pip install 'layerwise[tf]'``. ONNX graphs are
              exported once per model and deepest layer and cached under ``onnx_cache`` (default
              ``$LAYERWISE_CACHE/onnx``, else ``~/.cache/layerwise/onnx``).
            * ``quantize``: ``None`` (default), ``"int8"`` or ``"int8-full"`` (``auto``/``openvino`` backends, block
              site; approximations, faster than float32 on a VNNI or AMX CPU). ``"int8"``: int8 weights on OpenVINO
              where the ``[openvino]`` extra is installed (precision ``int8-weights``), else ONNX Runtime's dynamic
              int8 (``auto``/``onnx``); ``"int8-full"``: weights and activations in int8 on OpenVINO, calibrated on
              ``quantize_calibration`` (a text file, one text a line) or a bundled sample. Fidelity and speed per
              machine: benchmarks/README.md; the fidelity on the loaded model: ``describe()["fidelity"]``.
            * ``layer_modules``: the module path of the layer list (``"model.layers"``) for a model whose layers
              are not found automatically; verified against ``output_hidden_states`` at load.
            * ``padding_side``: ``"right"`` (default) or ``"left"`` (the decoder embedding-model convention); both
              give the same states (torch backend; see :mod:`layerwise.model.backends.pytorch`).
            * ``revision``, ``allow_pickle``, ``trust_remote_code``: see :func:`layerwise.model.loading.load_model`
              (both flags are opt-in because they run code from the checkpoint).
            * ``tokenizer``: ``backend="tf"`` only: a directory holding the SavedModel's Hugging Face tokenizer.

    Any PyTorch module that is not from transformers: :meth:`from_module`.

    Attributes:
        options: the :class:`~layerwise.ModelOptions` this Extractor was made from (``backend`` filled in with the
            backend that runs it), as a store's manifest records them.
    """

    def __init__(
        self,
        model: ModelOptions | str | os.PathLike | LoadedModel | Backend | None = None,
        *,
        batch_tokens: int | None = None,
        sort_by_length: bool = True,
        **options: Any,
    ):
        if isinstance(model, Backend):
            self.backend: Backend = model
            opts = ModelOptions.of(None, **options)
            if set(options) - {"max_length", "stride"}:
                raise ModelLoadError(f"a loaded backend is used as is; only max_length and stride apply to it, not "
                                     f"{sorted(set(options) - {'max_length', 'stride'})}")
        elif isinstance(model, LoadedModel):
            opts = ModelOptions.of(None, **options)
            self.backend = create_backend(model, opts)
        else:
            opts = ModelOptions.of(model, **options)
            self.backend = load_backend(opts)
        self.options = opts.replace(backend=self.backend.name)
        self._configure_windows(opts.max_length, opts.stride)
        if batch_tokens is None:
            batch_tokens = CPU_BATCH_TOKENS if self.backend.device.type == "cpu" else GPU_BATCH_TOKENS
        self.batch_tokens = check_budget(batch_tokens)
        self.sort_by_length = bool(sort_by_length)

    @classmethod
    def from_options(
        cls, options: ModelOptions, *, batch_tokens: int | None = None, sort_by_length: bool = True
    ) -> "Extractor":
        """The Extractor of ``options`` (the one way every entry point loads a model): ``Extractor(options, ...)``."""
        if not isinstance(options, ModelOptions):
            raise TypeError(f"from_options takes a layerwise.ModelOptions, got {type(options).__name__}")
        return cls(options, batch_tokens=batch_tokens, sort_by_length=sort_by_length)

    @classmethod
    def of(cls, model: "Extractor | ModelOptions | str | os.PathLike | None") -> "Extractor":
        """``model`` itself when it is already loaded, else the Extractor of its :class:`ModelOptions` (a directory
        or hub id stands for ``ModelOptions(model=...)``, ``None`` for the default model): how every entry point
        that takes a model reads it."""
        return model if isinstance(model, Extractor) else cls.from_options(ModelOptions.of(model))

    @classmethod
    def from_module(
        cls,
        model: nn.Module,
        tokenizer: Any,
        layer_modules: str | Sequence[nn.Module],
        *,
        call: Callable[..., Any] | None = None,
        max_length: int | None = None,
        stride: int | None = None,
        device: str | torch.device | None = None,
        compute_dtype: str | torch.dtype | None = None,
        batch_tokens: int | None = None,
        padding_side: str = "right",
        name: str | None = None,
    ) -> "Extractor":
        """An Extractor over any PyTorch module whose layer modules you name (the framework-agnostic wrapper).

        Args:
            model: the module; called as ``model(input_ids=ids, attention_mask=mask)`` unless ``call`` says how
                (``call(model, input_ids [b, T], attention_mask [b, T]) -> anything``).
            tokenizer: a fast tokenizer (``PreTrainedTokenizerFast`` or ``tokenizers.Tokenizer``).
            layer_modules: the layer list, a module path (``"encoder.layers"``) or the modules in the order they run;
                each must return ``[batch, tokens, width]`` and feed the next (checked once, here).
            max_length: the longest input the model takes (longer texts are windowed); default: read from a
                position table, else no limit.
            stride: as for :class:`Extractor` (and so are ``device``, ``compute_dtype``, ``batch_tokens``,
                ``padding_side``).
            name: the model's name in messages and provenance (default: its class name).

        Example::

            >>> ex = lw.Extractor.from_module(my_encoder, tokenizer, layer_modules="layers", max_length=128)
            >>> ex.encode(["I love Paris"], layers="all", combine="mean").shape      # [1, width]
        """
        from .model.custom import wrap_module

        loaded = wrap_module(model, tokenizer, layer_modules, call=call, max_length=max_length, device=device,
                             compute_dtype=compute_dtype, name=name)
        return cls(loaded, batch_tokens=batch_tokens, stride=stride, padding_side=padding_side)

    def _configure_windows(self, max_length: int | None, stride: int | None) -> None:
        limit = self.loaded.max_length
        self.max_length = self.loaded.window if max_length is None else _int(max_length, "max_length")
        self._template = special_template(self.tokenizer)
        n_special = sum(self._template)
        if not n_special < self.max_length <= limit:
            raise SpecError(
                f"max_length={max_length} is outside {n_special + 1}..{limit} (this model's maximum, special tokens "
                f"included)"
            )
        capacity = self.max_length - n_special
        self.stride = capacity // 4 if stride is None else _int(stride, "stride")
        self._windowing_said = False
        if not 0 <= self.stride < capacity:
            raise SpecError(f"stride={stride} must be in 0..{capacity - 1} (window capacity {capacity} tokens)")

    def _say_windowing(self, toks: Sequence[Tokenized]) -> None:
        """Once per Extractor, at the first text longer than the window: that it is windowed, and how to change it
        (a window shorter than the model's positions, e.g. a sentence-transformers ``max_seq_length``, is said)."""
        if self._windowing_said:
            return
        longest = max((len(t.ids) for t in toks), default=0)
        if longest <= self.max_length:
            return
        self._windowing_said = True
        limit = self.loaded.max_length
        why = (f"this Extractor's max_length, from the model's sentence-transformers config (max_seq_length); its "
               f"positions allow {limit}" if self.max_length < limit and self.options.max_length is None else
               "this Extractor's max_length")
        fix = (f"max_length={limit} (--max-length {limit}) encodes up to {limit} tokens in one pass"
               if self.max_length < limit else "nothing longer fits the model's positions")
        notice(f"a text of {longest} tokens is longer than the window of {self.max_length} tokens ({why}): long texts "
               f"are encoded in windows overlapping by {self.stride} tokens and stitched, so their states differ "
               f"from one pass over the whole text; {fix}, truncate=True (--truncate) cuts them instead (said once "
               f"per Extractor)")

    # ---- facts ----------------------------------------------------------------------------------------
    @property
    def loaded(self) -> LoadedModel:
        """The loaded transformers model, tokenizer and facts behind the backend."""
        return self.backend.loaded

    @property
    def model(self) -> nn.Module:
        """The PyTorch model (``AutoModel``)."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        """The fast tokenizer."""
        return self.backend.tokenizer

    @property
    def num_layers(self) -> int:
        """``L``: valid layer indices are ``0..L`` (0 = embeddings)."""
        return self.backend.num_layers

    @property
    def hidden_size(self) -> int:
        """Width of the ``block`` site."""
        return self.loaded.hidden_size

    @property
    def first_layer(self) -> int:
        """0, or 1 for a backend that does not expose the embeddings (a TF Hub SavedModel)."""
        return self.backend.first_layer

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites the backend can record on this model."""
        return self.backend.model_sites

    @property
    def causal(self) -> bool:
        """Whether the model is a decoder (causal attention: a token sees only the tokens before it), where
        ``pool="cls"`` is refused in favour of ``pool="last"`` (see :attr:`LoadedModel.causal`)."""
        loaded = getattr(self.backend, "loaded", None)
        return bool(loaded is not None and loaded.causal)

    @property
    def has_pooler(self) -> bool:
        """Whether the model has a BERT-style pooler (``pool="pooler"``)."""
        return self.backend.pooler() is not None

    def site_width(self, site: str) -> int:
        """Feature width of one site (``intermediate_size`` for ``intermediate``, else ``hidden_size``)."""
        return self.backend.site_width(site)

    def fingerprint(self) -> str:
        """sha256 of the weights (names, shapes, values): what stores and caches record as the model's identity."""
        return self.backend.fingerprint()

    def describe(self) -> dict[str, Any]:
        """What layerwise knows about this model: a JSON-ready dict (every key is listed in
        :func:`layerwise.model.describe.describe`: where the layers are and how the map was found, the final norm, the
        sites and their widths, positions, window, stride, pooler, padding side, device, compute dtype, precision,
        backend and, for ``auto``, the runtime that served each depth).

        Example::

            >>> lw.Extractor().describe()["positions"]
            'absolute, at most 512 tokens'
        """
        return describe(self)

    def __repr__(self) -> str:
        lm = self.loaded
        window = "none" if self.max_length >= UNLIMITED else str(self.max_length)
        return (
            f"Extractor(model={lm.name!r}, architecture={lm.architecture}, layers=0..{lm.num_layers}, "
            f"hidden={lm.hidden_size}, positions={lm.positions.kind}, window={window}, device={lm.device}, "
            f"compute_dtype={str(lm.dtype).replace('torch.', '')}, backend={self.backend.name})"
        )

    def _repr_html_(self) -> str:
        """A model card for notebooks: architecture, layers, widths per site, positions, backend, precision."""
        from .display import card

        d = self.describe()
        sites = ", ".join(f"{k} {v}" for k, v in (d.get("sites") or {}).items())
        fields = [("model", d["name"]), ("architecture", f"{d['architecture']} ({d.get('layer_map')})"),
                  ("layers", f"{d['layers']} (0 = embeddings)"), ("hidden", d["hidden_size"]),
                  ("sites (width)", sites), ("positions", d["positions"]), ("window / stride",
                  f"{d['window']} / {d['stride']}"), ("padding side", d["padding_side"]), ("device", d["device"]),
                  ("compute dtype / precision", f"{d['compute_dtype']} / {d['precision']}"),
                  ("backend", f"{d['backend']}: {d.get('runtime')}")]
        return card("Extractor", fields)

    # ---- the pipeline -----------------------------------------------------------------------------------
    def text_tokenizer(self) -> TextTokenizer:
        """This Extractor's tokenising half (tokenizer, special tokens, window), picklable and model-free."""
        return TextTokenizer(self.tokenizer, self._template, self.max_length, self.loaded.name)

    def tokenize(
        self, items: Sequence[Any], *, words: bool, truncate: bool = False, prompt: str = "", add_eos: bool = False
    ) -> list[Tokenized]:
        """Tokenise texts (or word lists with ``words=True``) with the model's special tokens (see
        :class:`~layerwise.encoding.tokenize.TextTokenizer`)."""
        return self.text_tokenizer()(items, words=words, truncate=truncate, prompt=prompt, add_eos=add_eos)

    def _forward(self, toks: list[Tokenized], layers: tuple[int, ...], site: str, batch_tokens: int,
                 idle: bool = False, segments: tuple[list[int], list[tuple[int, ...]]] | None = None,
                 depths: list[int] | None = None, plan: Plan | None = None) -> Iterator[Group]:
        """Run every window of ``toks``; yield groups of finished texts (see :func:`forward_windows`; ``idle``: an
        empty group after a batch that finished none). ``segments``: ``(segment of each text, layers of each
        segment)``, each segment run to its own depth in one pipeline (``layers`` is then their union). ``depths``:
        the deepest layer of each text, every row leaving its batch there (:meth:`Backend.start_ragged`). ``plan``: the
        call's runtime (:meth:`Backend.plan`, made here when not given): every batch runs on it."""
        plan = plan if plan is not None else self.backend.plan(layers, site)
        self._say_windowing(toks)
        of_text, layer_sets = segments if segments is not None else ([0] * len(toks), [layers])
        width = self.site_width(site)

        def runner(lays: tuple[int, ...]) -> Callable[..., Callable[[], torch.Tensor]]:
            if depths is not None:
                return lambda ids, mask, rows: plan.start_ragged(ids, mask, lays, site, rows)
            return lambda ids, mask: plan.start(ids, mask, lays, site)

        def blank(lays: tuple[int, ...]) -> Callable[[int], torch.Tensor]:  # texts without any token: [K, n, 0, W]
            return lambda n: torch.zeros((len(lays), n, 0, width), dtype=self.backend.dtype, device=self.backend.device)

        cap = plan.batch_tokens_cap(layers, site)  # a streamed model: one batch's states within max_memory
        if cap is not None and cap < batch_tokens:
            batch_tokens = cap
        yield from forward_windows(toks, [runner(lays) for lays in layer_sets], max_length=self.max_length,
                                   stride=self.stride, batch_tokens=batch_tokens,
                                   pad_id=self.tokenizer.pad_token_id or 0, sort=self.sort_by_length,
                                   empty=[blank(lays) for lays in layer_sets], ahead=plan.ahead(layers, site),
                                   idle=idle, segments=of_text, depths=depths)

    def stream(
        self, records: Iterable[Any], spec: EncodeSpec, *, batch_tokens: int | None = None
    ) -> Iterator[Encoded]:
        """Encode ``records`` as ``spec`` says and yield one :class:`~layerwise.encoding.reduce.Encoded` per record,
        in order.

        Args:
            records: texts (levels ``sentence``/``token``), or word lists (level ``word``; a string is split on
                whitespace). Any iterable: it is read ``CHUNK_RECORDS`` at a time, so a corpus never sits in memory.
            spec: what to compute; validated against this model first (a bad spec raises before any compute).
            batch_tokens: token budget per forward batch (default: the Extractor's).

        Yields:
            ``Encoded(index, features, tokens)``: ``features`` on the CPU in ``spec.output_dtype``, shaped ``[*D]``,
            ``[n_tokens, *D]`` or ``[n_words, *D]`` with ``D = spec.resolve(self).feature_shape(width)``.
        """
        spec = spec.resolve(self)
        words = spec.level == "word"
        it = iter(records)

        def next_chunk(start: int, tokenizer: TextTokenizer) -> list[Tokenized] | None:
            chunk = list(itertools.islice(it, CHUNK_RECORDS))
            if not chunk:
                return None
            if words:
                chunk = [item.split() if isinstance(item, str) else item for item in chunk]
            items = check_texts(chunk, words=words, start=start, refuse_blank=True)
            return tokenizer(items, words=words, truncate=spec.truncate, prompt=spec.prompt, add_eos=spec.add_eos)

        toks = next_chunk(0, self.text_tokenizer())
        if toks is None:
            return
        plan = self.backend.plan(spec.layer_indices, spec.site)  # one runtime from the first record to the last
        # The next chunk is read and tokenised in a thread while this one runs through the model (the tokenizer
        # releases the GIL, and so does the forward pass). The thread uses its own copy of the tokenizer: a fast
        # tokenizer is not safe to call from two threads at once.
        with ThreadPoolExecutor(1, thread_name_prefix="layerwise-tokenize") as pool:
            start = 0
            ahead: Future | None = None
            while toks is not None:
                if len(toks) == CHUNK_RECORDS:
                    ahead = pool.submit(next_chunk, start + len(toks), self._prefetch_tokenizer())
                yield from self.encode_tokenized(toks, spec, batch_tokens=batch_tokens, start=start, plan=plan)
                start += len(toks)
                toks = ahead.result() if ahead is not None else None
                ahead = None

    def _prefetch_tokenizer(self) -> TextTokenizer:
        """:meth:`text_tokenizer` on a private copy of the fast tokenizer (copied once), for :meth:`stream`'s
        tokenising thread."""
        if getattr(self, "_tokenizer_copy", None) is None:
            self._tokenizer_copy = copy.deepcopy(self.tokenizer)
        return TextTokenizer(self._tokenizer_copy, self._template, self.max_length, self.loaded.name)

    def encode_tokenized(
        self, toks: list[Tokenized], spec: EncodeSpec, *, batch_tokens: int | None = None, start: int = 0,
        plan: Plan | None = None,
    ) -> Iterator[Encoded]:
        """The model's half of :meth:`stream`: encode texts tokenised by :meth:`tokenize` (or by
        :meth:`text_tokenizer` in another process) and yield one ``Encoded(start + i, features [*D] | [n, *D],
        toks[i])`` per text, in order. ``plan``: the runtime of the whole stream (:meth:`Backend.plan`; default: one
        made for this call)."""
        done: dict[int, Encoded] = {}
        following = 0
        for step in self.encode_shared([(toks, spec)], batch_tokens=batch_tokens, plan=plan):
            for _, result in step:
                done[result.index] = result
            while following in done:
                result = done.pop(following)
                result.index += start
                yield result
                following += 1

    def encode_shared(
        self, parts: Sequence[tuple[list[Tokenized], EncodeSpec]], *, batch_tokens: int | None = None,
        segments: Sequence[Sequence[int]] | None = None, ragged: bool | None = None, plan: Plan | None = None,
    ) -> Iterator[list[tuple[int, Encoded]]]:
        """Encode several requests' tokenised texts, each with its own spec, in one forward pass: it runs to the
        deepest layer any of them needs, and each part's layers are then combined, pooled and finished as its own
        spec says (the results equal each part's own :meth:`encode_tokenized`).

        Args:
            parts: ``[(toks, spec)]``; the specs may differ in layers, combine, pool, level, precision, dimensions,
                normalisation, but not in site (one forward pass records one site).
            batch_tokens: token budget per forward batch (default: the Extractor's).
            segments: the parts grouped by depth (``[[0, 2], [1]]``: each group a list of part indices, every part
                in one group); each group runs only to its own deepest layer, and all groups' batches go through one
                pipeline (the runtime never idles between them). Default: one group. Ignored when ``ragged``.
            ragged: every row leaves its batch at its own part's deepest layer (batches shared by every part, each
                part run only to its own depth: :meth:`Backend.start_ragged`). Default (``None``): where the runtime
                offers it at no higher price per token-layer (:meth:`Backend.ragged_price` at most 1).
            plan: the runtime every batch runs on (:meth:`Backend.plan`; default: one made for this call, so a runtime
                decided in the background meanwhile serves from the next call on).

        Yields:
            One step per forward batch: ``[(part, Encoded(i, features, toks_part[i]))]`` for the texts that batch
            finished (``i`` counts within the part; a step may be empty while a long text's windows run). Between
            steps nothing runs, so a caller may interleave other work or stop early.

        Raises:
            SpecError: a spec invalid for this model, or parts at different sites.
        """
        specs = [spec.resolve(self) for _, spec in parts]
        sites = sorted({spec.site for spec in specs})
        if len(sites) > 1:
            raise SpecError(f"parts encoded together share one site; got {', '.join(sites)}: encode them separately")
        if not specs:
            return
        site = sites[0]
        budget = check_budget(self.batch_tokens if batch_tokens is None else batch_tokens)
        groups = [list(g) for g in segments] if segments is not None else [list(range(len(parts)))]
        if sorted(p for g in groups for p in g) != list(range(len(parts))):
            raise SpecError(f"segments {groups} must hold every part index 0..{len(parts) - 1} exactly once")
        segment_of = {p: k for k, g in enumerate(groups) for p in g}
        unions = [tuple(sorted({i for p in g for i in specs[p].layer_indices})) for g in groups]
        width = self.site_width(site)
        makers = [make_rows(spec, width, self.backend.pooler() if spec.pool == "pooler" else None) for spec in specs]
        toks = [t for part, _ in parts for t in part]
        owner = [(p, i) for p, (part, _) in enumerate(parts) for i in range(len(part))]
        everything = tuple(sorted({i for union in unions for i in union}))
        depths = None
        several = len({max(spec.layer_indices) for spec in specs}) > 1
        plan = plan if plan is not None else self.backend.plan(everything, site)  # one runtime for every batch
        if several and ragged is None:
            price = plan.ragged_price(max(everything), site)
            ragged = price is not None and price <= 1.0
        if several and ragged:
            # every row leaves its batch at its own part's depth: one segment, the batches as large as they come
            depths = [max(specs[p].layer_indices) for p, _ in owner]
            segment_of, unions = dict.fromkeys(segment_of, 0), [everything]
        of_text = [segment_of[p] for p, _ in owner]
        picks = [_picks(unions[segment_of[p]], spec.layer_indices, self.backend.device) for p, spec in enumerate(specs)]
        for group in self._forward(toks, everything, site, budget, idle=True, segments=(of_text, unions),
                                   depths=depths, plan=plan):
            step: list[tuple[int, Encoded]] = []
            if group.texts:
                mask, special = group.masks(toks)
                by_part: dict[int, list[int]] = {}
                for r, text in enumerate(group.texts):
                    by_part.setdefault(owner[text][0], []).append(r)
                for p, rs in by_part.items():
                    pick = picks[p]
                    states, m, s = group.states, mask, special
                    if len(rs) != len(group.texts):  # only the part's rows of only its layers: [k, rows, T, W]
                        at = torch.tensor(rs, device=states.device)  # (index_select per layer: advanced indexing of
                        states = states.index_select(1, at) if pick is None else \
                            torch.stack([states[k].index_select(0, at) for k in pick.tolist()])  # both was slower)
                        m, s = mask.index_select(0, at), special.index_select(0, at)
                    elif pick is not None:
                        states = states.index_select(0, pick)
                    texts = [group.texts[r] for r in rs]
                    out = makers[p](states, m, s, [toks[t] for t in texts])
                    step.extend((p, Encoded(owner[t][1], v, toks[t])) for t, v in zip(texts, out))
            yield step

    # ---- public API -------------------------------------------------------------------------------------
    def hidden_states(
        self,
        texts: Iterable[str],
        layers: LayerSpec = "all",
        site: str = "block",
        *,
        truncate: bool = False,
        return_tensors: ReturnTensors = "pt",
        batch_tokens: int | None = None,
    ) -> LayerStack:
        """Raw hidden states of ``layers`` at ``site`` for a (small) batch of texts.

        Args:
            texts: any iterable of strings (a list, tuple, pandas Series, numpy array, generator; an empty string
                encodes as the special tokens only; no text gives a stack with ``batch`` 0). A bare string is
                refused: wrap it in a list.
            layers: layer spec (``"all"``, ``-1``, ``"-4:"``, ``[0, 6]``, ``range(3)``, ``"second_to_last"``...).
            site: ``block`` (= ``hidden_states``), ``attention``, ``intermediate`` or ``pre_ln``.
            truncate: cut texts at ``max_length`` instead of windowing them.
            return_tensors: ``"pt"`` (default: torch tensors, ``tensor`` in the model's compute dtype) or ``"np"``
                (numpy: ``tensor`` float32, masks and ids int64), as in :meth:`encode` (whose default is ``"np"``:
                a stack is for looking inside the model, a feature matrix for the next tool).
            batch_tokens: token budget per forward batch (default: the Extractor's).

        Returns:
            :class:`LayerStack` with ``tensor [layers, batch, tokens, width]`` on CPU, padded with zeros to the
            longest text (``tokens`` may exceed ``max_length`` for windowed texts). It is a sequence of the captured
            layers: ``for h in stack``, ``len(stack)``, ``stack[0]``, ``stack[-1]`` are positions in capture order;
            ``stack.layer(i)`` is model layer ``i`` (see :class:`LayerStack`).
        """
        _check_return_tensors(return_tensors)
        texts = check_texts(texts, allow_empty=True, refuse_blank=True)
        spec = EncodeSpec(layers=layers, site=site, level="token", truncate=truncate).resolve(self)
        budget = check_budget(self.batch_tokens if batch_tokens is None else batch_tokens)
        toks = self.tokenize(texts, words=False, truncate=truncate) if texts else []
        longest = max((len(t.ids) for t in toks), default=0)
        layers = spec.layer_indices
        out = torch.zeros((len(layers), len(texts), longest, self.site_width(site)), dtype=self.loaded.dtype)
        if toks:
            for group in self._forward(toks, layers, site, budget):
                for r, (text, n) in enumerate(zip(group.texts, group.lengths)):
                    out[:, text, :n] = group.states[:, r, :n].cpu()
            stack = LayerStack.from_tokens(out, layers, site, toks, self.tokenizer.pad_token_id or 0, self.num_layers)
        else:
            none = torch.zeros((0, 0), dtype=torch.long)
            stack = LayerStack(tensor=out, layers=tuple(layers), sites=(site,) * len(layers), attention_mask=none,
                               input_ids=none, special_tokens_mask=none, word_ids=[], offsets=[],
                               num_layers=self.num_layers)
        return stack.as_numpy() if return_tensors == "np" else stack

    def encode(
        self,
        texts: Iterable[str],
        layers: LayerSpec | None = None,
        combine: str | nn.Module = "concat",
        pool: str | nn.Module | None = "mean",
        *,
        site: str = "block",
        weights: Sequence[float] | None = None,
        skip_special_tokens: bool = False,
        truncate: bool = False,
        normalize: bool = False,
        prompt: str = "",
        add_eos: bool = False,
        dimensions: int | None = None,
        output_dtype: str = "float32",
        calibration: Ranges | None = None,
        return_tensors: ReturnTensors = "np",
        batch_tokens: int | None = None,
        show_progress: bool = False,
    ) -> Any:
        """Sentence vectors (or token vectors with ``pool=None``) from a combination of layers.

        Args:
            texts: any iterable of strings: a list, tuple, pandas Series (``df.sentence``), numpy array of strings,
                generator (read once). A bare string is refused (wrap it in a list: ``[text]``); no text gives
                ``(0, *D)`` (``[]`` with ``pool=None``).
            layers: layer spec (``-1``, ``"-4:"``, ``[0, 6]``, ``range(3)``...); default ``-1`` (the last layer), or
                the layers a ScalarMix was built ``over``.
            combine: ``concat | sum | mean | weighted | stack`` or a module such as :class:`ScalarMix`.
            pool: ``cls | pooler | mean | max | mean_max | last``, a module such as :class:`AttentionPool`,
                or ``None`` for one vector per token (special tokens included).
            site: ``block | raw | attention | intermediate | pre_ln``.
            weights: fixed per-layer weights for ``combine="weighted"``.
            skip_special_tokens: leave ``[CLS]``/``[SEP]``-like tokens out of the pool.
            truncate: cut texts at ``max_length`` instead of windowing them.
            normalize: L2-normalise each sentence vector (sentence-transformers' ``Normalize`` module).
            prompt: text put before every text (an instruction such as ``"query: "``); its tokens are pooled too.
            add_eos: append the end-of-sequence token where the tokenizer does not (decoder embedding models
                pool it with ``pool="last"``).
            dimensions: keep the leading ``dimensions`` values (Matryoshka models; before ``normalize``).
            output_dtype: ``float32 | float16 | int8 | uint8 | binary | ubinary`` (sentence-transformers'
                ``precision``; see :mod:`layerwise.encoding.precision`). Float results come back as float32.
            calibration: ``int8``/``uint8`` ranges (see :meth:`calibrate`).
            return_tensors: ``"np"`` (numpy) or ``"pt"`` (CPU torch tensors).
            batch_tokens: token budget per forward batch (default: the Extractor's).
            show_progress: show a progress bar.

        Returns:
            ``[n_texts, D]`` (``stack``: ``[n_texts, K, width]``) or, with ``pool=None``, a list of
            ``[n_tokens_i, D]``. ``D = K * width`` for ``concat``, ``width`` otherwise, doubled for ``mean_max``,
            cut to ``dimensions``, and ``ceil(D / 8)`` bytes for ``binary``/``ubinary``.
        """
        texts = check_texts(texts, allow_empty=True, refuse_blank=True)
        spec = EncodeSpec(
            layers=_layers_for(layers, combine), site=site, combine=combine, weights=weights,
            level="token" if pool is None else "sentence", pool=pool, skip_special_tokens=skip_special_tokens,
            truncate=truncate, normalize=normalize, prompt=prompt, add_eos=add_eos, dimensions=dimensions,
            output_dtype=output_dtype, calibration=calibration,
        )
        results = self._collect(texts, spec, return_tensors, batch_tokens, show_progress)
        if pool is None:
            return results
        if not results:  # no text: (0, *D), D from the spec (validated against this model all the same)
            resolved = spec.resolve(self)
            shape = resolved.feature_shape(self.site_width(resolved.site))
            dtype = np.dtype(NUMPY_DTYPES[resolved.output_dtype])
            return _out(torch.from_numpy(np.zeros((0, *shape), dtype=np.float32 if dtype.kind == "f" else dtype)),
                        return_tensors)
        return _out(torch.stack(results), return_tensors)

    def calibrate(self, texts: Sequence[str] | Sequence[Sequence[str]], spec: EncodeSpec) -> EncodeSpec:
        """``spec`` (``output_dtype`` ``int8`` or ``uint8``) with the calibration ranges of ``texts``: each of the
        ``D`` values' minimum and maximum over the float32 features of ``texts`` (every row: sentences, tokens or
        words). Give a few hundred texts like the ones you will encode; values outside the ranges are clipped.

        Raises:
            SpecError: ``spec`` is not ``int8``/``uint8``, or ``texts`` give no row.
        """
        if spec.output_dtype not in ("int8", "uint8"):
            raise SpecError(f"calibrate applies to output_dtype int8 or uint8, not {spec.output_dtype!r}")
        float_spec = spec.replace(output_dtype="float32", calibration=None)
        width = math.prod(float_spec.resolve(self).float_shape(self.site_width(float_spec.site)))
        return spec.calibrated([r.features for r in self.stream(texts, float_spec)], width)

    def encode_words(
        self,
        words: Iterable[Iterable[str]],
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
    ) -> list[Any]:
        """One vector per word of pre-tokenised input (NER/POS style), pooled from its sub-tokens.

        Args:
            words: word lists, e.g. ``[["EU", "rejects", "German", "call"]]`` (any iterable of iterables of strings;
                a bare string is refused; no item gives ``[]``).
            layers: as in :meth:`encode` (and so are ``combine``, ``site``, ``weights``).
            subword: ``first | last | mean | max | first_last`` (the BERT paper uses ``first``).
            truncate: cut at ``max_length`` instead of windowing (words past the cut get zero vectors).

        Returns:
            A list with one ``[n_words_i, D]`` array (or tensor) per item, aligned to its words. A word that
            produced no sub-token (e.g. only a zero-width character) gets a zero vector.
        """
        items = check_texts(words, words=True, allow_empty=True, refuse_blank=True)
        spec = EncodeSpec(layers=_layers_for(layers, combine), site=site, combine=combine, weights=weights,
                          level="word", subword=subword, truncate=truncate)
        return self._collect(items, spec, return_tensors, batch_tokens, show_progress)

    def _collect(
        self, items: list[Any], spec: EncodeSpec, return_tensors: str, batch_tokens: int | None, show_progress: bool
    ) -> list[Any]:
        _check_return_tensors(return_tensors)
        from tqdm.auto import tqdm

        out: list[Any] = []
        with tqdm(total=len(items), disable=not show_progress, unit="text", desc="layerwise", leave=False) as bar:
            for result in self.stream(items, spec, batch_tokens=batch_tokens):
                out.append(result.features if spec.level == "sentence" else _out(result.features, return_tensors))
                bar.update(1)
        return out


def _check_return_tensors(return_tensors: object) -> None:
    """``SpecError`` naming the valid values for anything but ``"np"`` or ``"pt"``."""
    if return_tensors not in RETURN_TENSORS:
        raise SpecError(f"unknown return_tensors {return_tensors!r}. Valid values are: {', '.join(RETURN_TENSORS)}")


def _picks(union: tuple[int, ...], layers: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """Where ``layers`` (a spec's, in its order) sit in ``union`` (the layers a forward pass recorded), as indices on
    ``device``; ``None`` when they are the union itself, in its order."""
    if tuple(layers) == union:
        return None
    return torch.tensor([union.index(i) for i in layers], device=device)


def _layers_for(layers: LayerSpec | None, combine: object) -> LayerSpec:
    """``None`` means the layers a ScalarMix was built ``over``, else the last layer."""
    if layers is not None:
        return layers
    mix_layers = getattr(combine, "layers", None) if isinstance(combine, nn.Module) else None
    return -1 if mix_layers is None else mix_layers


def _out(t: torch.Tensor, return_tensors: str) -> Any:
    """float32 (numpy or torch) for float features; integer precisions keep their dtype."""
    if t.is_floating_point():
        t = t.float()
    return t if return_tensors == "pt" else t.numpy()


__all__ = ["CHUNK_RECORDS", "Extractor", "check_budget"]

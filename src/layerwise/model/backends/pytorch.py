"""The PyTorch backend: scoped forward hooks record the requested sites and stop after the deepest one.

See :mod:`layerwise.model.capture` for the hooks and :mod:`layerwise.model.layermap` for where each model's layers
and sites
are (the family table, or the map discovered and verified at load).

Padding side: the pipeline pads on the right. With ``padding_side="left"`` each batch is moved to the left before
the forward pass (the convention of decoder embedding models) and the states are moved back, so both sides give
the same per-token states. Which position ids make left padding exact is checked once on two short texts, in this
order: ids counted from the mask (passed as ``position_ids``), none (the model derives them, e.g. RoBERTa, T5,
ALiBi), ids counted from ``padding_idx + 1``; a model for which none matches is refused with padding side
``"left"``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...encoding.padding import gather_tokens, move_padding_left, positions_from_mask
from ...encoding.vocab import PADDING_SIDES, SITES
from ...errors import ModelLoadError
from ..capture import Key, capture, capture_chunk
from ..discovery import probe_batch
from ..loaded import LoadedModel
from ..options import ModelOptions
from ..ragged import batch_keys, verify
from .base import LOADING_FIELDS, Backend

STREAM_AHEAD = 1 << 20  # streamed layers: batches started before the first is waited for (chunks bound memory)
_AGREE = 1e-4  # left vs right padding, relative to the states' scale (float32 reordering of reductions)


class TorchBackend(Backend):
    """PyTorch, every site the model has, early exit after the deepest requested layer, on the model's device/dtype.

    Args:
        loaded: the model.
        padding_side: ``"right"`` (default) or ``"left"`` (see the module docstring).
    """

    name = "torch"
    sites = SITES
    accepts = frozenset((*LOADING_FIELDS, "padding_side"))

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "TorchBackend":
        """``TorchBackend(loaded, padding_side=options.padding_side)``."""
        return cls(loaded, padding_side=options.padding_side)

    def __init__(self, loaded: LoadedModel, padding_side: str = "right"):
        super().__init__(loaded)
        if padding_side not in PADDING_SIDES:
            raise ModelLoadError(f"unknown padding_side {padding_side!r}. Valid values are: {', '.join(PADDING_SIDES)}")
        self.padding_side = padding_side
        # the open chunk of streamed batches: (key, batches, results, capacity in batches)
        self._chunk: tuple[Any, list, list, int] | None = None
        self._offset: int | None = None  # left padding: position ids from this offset; None: let the model decide
        self._keys: frozenset[Key] | None = None  # the layers' batch-carrying inputs (found at the first ragged call)
        self._ragged: dict[str, bool] = {}  # site -> whether rows may leave a batch at their depth (verified)
        if padding_side == "left":
            self._offset = self._left_padding_positions()

    def _left_padding_positions(self) -> int | None:
        lm = self.loaded
        ids, mask = probe_batch(lm.tokenizer)
        layers = tuple(range(max(1, lm.resident_depth) + 1))  # the blocks in memory tell: positions enter before
        right = capture(lm, ids, mask, layers)
        keep = mask.bool()
        scale = max(1.0, float(right[:, keep].abs().max()))
        pad = getattr(getattr(lm.model, "config", None), "pad_token_id", None)
        offsets: list[int | None] = [0] if lm.accepts_position_ids else []
        offsets.append(None)
        if lm.accepts_position_ids and isinstance(pad, int):
            offsets.append(pad + 1)
        for offset in offsets:
            got = self._left(ids, mask, layers, "block", offset)
            if float((got[:, keep] - right[:, keep]).abs().max()) <= _AGREE * scale:
                return offset
        raise ModelLoadError(
            f"padding_side='left' changes the states of this {lm.architecture} model (its positions are not "
            f"derived from the attention mask, and it takes no position_ids that would fix them); use "
            f"padding_side='right'"
        )

    def _left(
        self, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[int], site: str, offset: int | None
    ) -> torch.Tensor:
        left_ids, left_mask, back = move_padding_left(ids, mask)
        positions = None if offset is None else positions_from_mask(left_mask, offset)
        states = capture(self.loaded, left_ids, left_mask, layers, site, position_ids=positions)
        return gather_tokens(states, back)

    # ---- models larger than max_memory: a chunk of batches runs block by block -----------------------------
    def ahead(self, layers: Sequence[int], site: str) -> int:
        """1, or no bound when ``layers`` are streamed (:func:`capture_chunk`): the pipeline then starts its batches
        before it waits for the first, :meth:`start` groups them into chunks sized from ``max_memory``, and each
        block is read once per chunk."""
        return STREAM_AHEAD if self.loaded.streams(max(layers)) else 1

    def batch_tokens_cap(self, layers: Sequence[int], site: str) -> int | None:
        """Streamed layers: the tokens whose kept states (and the working copies of one block step) fit what
        ``max_memory`` leaves beside the weights (at least 16); else ``None``."""
        blocks = self.loaded.blocks
        if blocks is None or not self.loaded.streams(max(layers)):
            return None
        return max(16, blocks.room() // self.streamed_token_bytes(layers, site))

    def streamed_token_bytes(self, layers: Sequence[int], site: str) -> int:
        """Bytes one token takes in a streamed chunk: its kept states at ``layers``, the output carried to the next
        block, and one block step's working activations (the hidden state a few times over and the feed-forward's
        intermediate, up and gate projections), in float32."""
        width = self.loaded.site_width(site)
        inter = self.loaded.site_widths.get("intermediate", 4 * self.loaded.hidden_size)
        return 4 * (width * (len(layers) + 3) + 3 * inter)

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start`; streamed layers join the open chunk, which runs when its first batch is waited
        for (or when it is full)."""
        if not self.loaded.streams(max(layers)) or self.padding_side == "left":
            return super().start(input_ids, attention_mask, layers, site)
        key = (tuple(layers), site)
        chunk = self._chunk if self._chunk is not None and self._chunk[0] == key else None
        if chunk is None:
            blocks = self.loaded.blocks
            # the kept states of this batch, the output carried to the next block and the block's working memory
            batch_bytes = input_ids.numel() * self.streamed_token_bytes(layers, site)
            capacity = blocks.chunk_batches(batch_bytes) if blocks is not None else 1
            chunk = self._chunk = (key, [], [], capacity)
        batches, results = chunk[1], chunk[2]
        index = len(batches)
        batches.append((input_ids, attention_mask, None))
        if len(batches) >= chunk[3]:
            self._chunk = None

        def wait() -> torch.Tensor:
            with self.loaded.lock:  # one run of the chunk, whichever thread waits first
                if not results:
                    if self._chunk is chunk:
                        self._chunk = None
                    try:
                        results.extend(capture_chunk(self.loaded, batches, layers, site))
                    except Exception as exc:  # every batch of the chunk raises it; none runs the chunk again
                        results.append(exc)
                if isinstance(results[0], Exception):
                    raise results[0]
            return results[index]

        return wait

    # ---- rows leaving the batch at their own depth (layerwise.model.ragged) -------------------------------
    def ragged_price(self, depth: int, site: str) -> float | None:
        """:meth:`Backend.ragged_price`: ``1.0`` where :meth:`can_leave_early`, else ``None``."""
        return 1.0 if self.can_leave_early(depth, site) else None

    def can_leave_early(self, depth: int, site: str) -> bool:
        """True where rows can leave a batch at their depth on this model: right padding, layers in memory, and a
        probe pass that gives the full pass's states (checked once per site, at the first depth asked)."""
        if self.padding_side == "left" or depth < 2 or self.loaded.streams(depth):
            return False
        if site not in self._ragged:
            with self.loaded.lock:
                self.loaded.ensure_depth(depth)
                if self._keys is None:
                    self._keys = batch_keys(self.loaded)
                self._ragged[site] = verify(self.loaded, depth, self._keys, site)
        return self._ragged[site]

    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """:meth:`Backend.warm`, and the check that rows may leave a batch at their depth (:meth:`can_leave_early`),
        so a server's first mixed call does not pay for it."""
        super().warm(layers, site)
        if max(layers) >= 2:
            self.can_leave_early(max(layers), site)

    def start_ragged(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
        depths: Sequence[int],
    ) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start_ragged`: one pass in which each row runs only to its own depth."""
        if not self.can_leave_early(max(layers), site):
            return TorchBackend.start(self, input_ids, attention_mask, layers, site)
        states = capture(self.loaded, input_ids, attention_mask, layers, site, depths=depths, keys=self._keys or
                         frozenset())
        return lambda: states

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`), right-padded whatever the padding side."""
        if self.padding_side == "left" and not bool(attention_mask.all()):
            return self._left(input_ids, attention_mask, layers, site, self._offset)
        return capture(self.loaded, input_ids, attention_mask, layers, site)

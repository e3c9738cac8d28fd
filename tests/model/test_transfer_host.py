"""GPU streaming's host side, on the CPU (``layerwise.model.transfer``): the kept/staged choice, one aligned buffer
per block with every file tensor at its offset, and a kept buffer recognised as fitting a block's tensors. Only the
CUDA copies themselves stay behind the GPU tests (``tests/model/test_depth.py``)."""

from __future__ import annotations

import torch
from torch import nn

from layerwise.model.transfer import _ALIGN, HOST_SHARE, Source, _fits, _pinned, buffer_layout, keeps_host_copies


def _sources() -> list[Source]:
    block = nn.Linear(3, 5)
    file = {"w": torch.arange(15, dtype=torch.bfloat16).view(5, 3), "b": torch.ones(5, dtype=torch.float16),
            "odd": torch.arange(7, dtype=torch.int8)}
    return [Source("weight", block, "weight", True, "w", file["w"], torch.float32),
            Source("bias", block, "bias", True, "b", file["b"], torch.float32),
            Source("odd", block, "odd", False, "odd", file["odd"], torch.int8),
            Source("rotary", block, "rotary", False, None, torch.zeros(4), torch.float32)]  # a buffer from block 0


def test_blocks_are_kept_in_host_memory_only_when_they_take_at_most_the_share():
    free = 10 << 30
    assert keeps_host_copies(int(HOST_SHARE * free), free)
    assert not keeps_host_copies(int(HOST_SHARE * free) + 1, free)
    assert not keeps_host_copies(1, None)  # unknown free memory: staged


def test_one_buffer_per_block_with_each_file_tensor_aligned():
    sources = _sources()
    offsets, total = buffer_layout(sources)
    assert list(offsets) == ["weight", "bias", "odd"]  # the buffer from block 0 is not in the file's buffer
    assert offsets == {"weight": 0, "bias": _ALIGN, "odd": 2 * _ALIGN} and total == 3 * _ALIGN
    views = _pinned(sources, pin=False)
    base = views["weight"].untyped_storage().data_ptr()
    for s in sources[:3]:
        v = views[s.name]
        assert v.shape == s.source.shape and v.dtype == s.source.dtype  # in the file's dtype
        assert v.untyped_storage().data_ptr() == base  # one buffer
        assert (v.data_ptr() - base) % _ALIGN == 0
        v.copy_(s.source)
    assert torch.equal(views["weight"], sources[0].source) and torch.equal(views["odd"], sources[2].source)
    assert _fits(views, sources)
    other = _sources()
    other[0].source = torch.zeros(6, 3, dtype=torch.bfloat16)  # a block of another shape needs a new buffer
    assert not _fits(views, other)

"""Shared fixtures: tiny random models of every family (built once per session) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

import layerwise as lw  # noqa: E402

from tiny import FAMILIES, build  # noqa: E402

SENTENCES = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn",
    "",
    "The quick brown fox jumps over the lazy dog, again and again and again!",
    "naïve cafés",
    "a",
]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: build(fam, root / fam) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_extractors(tiny_dirs) -> dict[str, lw.Extractor]:
    return {fam: lw.Extractor(str(path), device="cpu") for fam, path in tiny_dirs.items()}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def default_extractor() -> lw.Extractor:
    return lw.Extractor(device="cpu")


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return list(SENTENCES)

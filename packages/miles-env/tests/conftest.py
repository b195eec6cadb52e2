"""Shared fixtures of miles-env's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _env_testlib import Loop


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()

"""Fixtures of the view tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.chromium import Browser, chromium_path


@pytest.fixture
def chromium() -> Iterator[Browser]:
    """A real headless Chromium for the live page; in CI its absence is a failure, not a skip."""
    if chromium_path() is None:
        reason = "chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the live page test: {reason}")
        pytest.skip(reason)
    with Browser() as browser:
        yield browser

"""The environment `make test-serving` built: what pip said while building it holds no error. A
successful build that prints "ERROR:" reads as a failure to whoever runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

PIP_LOG = Path(sys.prefix) / "pip-messages.log"  # the Makefile's SERVING_PIP_LOG


def test_building_the_serving_environment_printed_no_error_line():
    assert PIP_LOG.is_file(), f"{PIP_LOG} is missing: the environment was not built by `make test-serving`"
    errors = [line for line in PIP_LOG.read_text().splitlines() if line.lstrip().upper().startswith("ERROR")]
    assert not errors, "\n".join(errors)

"""The environment `make test-sglang-serving` built: what pip said while building it holds no error,
and SGLang is the release the plugin supports, unchanged (the shims live outside its package)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

PIP_LOG = Path(sys.prefix) / "pip-messages.log"  # the Makefile's SGLANG_PIP_LOG


def test_building_the_sglang_environment_printed_no_error_line():
    assert PIP_LOG.is_file(), f"{PIP_LOG} is missing: the environment was not built by `make test-sglang-serving`"
    errors = [line for line in PIP_LOG.read_text().splitlines() if line.lstrip().upper().startswith("ERROR")]
    assert not errors, "\n".join(errors)


def test_sglang_is_the_supported_release_and_its_files_are_as_shipped():
    """pip's RECORD holds a digest of every file of SGLang's wheel: none differs."""
    import base64
    import hashlib

    dist = importlib.metadata.distribution("sglang")
    assert dist.version == "0.5.23"
    changed = []
    for entry in dist.files or ():
        if not entry.hash or entry.hash.mode != "sha256":
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(entry.locate().read_bytes()).digest()).rstrip(b"=").decode()
        if digest != entry.hash.value:
            changed.append(str(entry))
    assert not changed, changed

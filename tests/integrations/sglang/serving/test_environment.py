"""The environment `make test-sglang-serving` built: what pip said while building it holds no error,
and SGLang is the release the plugin supports, unchanged (the shims live outside its package)."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.support.session_server import pip_error_lines

pytestmark = pytest.mark.serving


def test_building_the_sglang_environment_printed_no_error_line():
    errors = pip_error_lines("test-sglang-serving")
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

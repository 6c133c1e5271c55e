"""The environment `make test-serving` built: what pip said while building it holds no error."""

from __future__ import annotations

import pytest

from tests.support.session_server import pip_error_lines

pytestmark = pytest.mark.serving


def test_building_the_serving_environment_printed_no_error_line():
    errors = pip_error_lines("test-serving")
    assert not errors, "\n".join(errors)

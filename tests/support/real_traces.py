"""Where the tests find the real production traces (docs/TRACES.md): the checkout's own `traces/`
first, where the docs tell users to put them, then the sibling `../shared/traces/`."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACES = (ROOT / "traces", ROOT.parent / "shared" / "traces")
AZURE_NAME = "azure2023_conv.csv"
MOONCAKE_NAME = "mooncake_conversation.jsonl"


def trace_dir(*names: str) -> Path | None:
    """The first place that holds every one of ``names`` (default: both traces), or None."""
    wanted = names or (AZURE_NAME, MOONCAKE_NAME)
    return next((d for d in PLACES if all((d / n).is_file() for n in wanted)), None)


def needs_traces(*names: str) -> pytest.MarkDecorator:
    wanted = names or (AZURE_NAME, MOONCAKE_NAME)
    return pytest.mark.skipif(
        trace_dir(*wanted) is None,
        reason=f"the real traces ({', '.join(wanted)}) are in neither {PLACES[0]} nor {PLACES[1].resolve()}: "
               f"docs/TRACES.md says how to fetch them into traces/",
    )

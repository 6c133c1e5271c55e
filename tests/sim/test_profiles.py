"""Rank profiles: the shipped ones, and a user's own file with its errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankConfig
from dpboard.sim.profile import load_profile, load_profile_file, profile_names

GOOD = """# my rank
name = mine
description = a test rank
source = made up
kv_capacity_tokens = 50000
max_running_requests = 64
chunked_prefill_size = 4096
prefill_step_ms = 5
prefill_token_us = 40   # per token
decode_step_ms = 8
decode_request_us = 20
decode_kv_token_ns = 30
"""


def test_shipped_profiles_load_and_synthetic_is_the_old_model():
    names = profile_names()
    assert {"synthetic", "llama3.1-8b-h100", "deepseek-v3-dp-attention-h100"} <= set(names)
    assert load_profile("synthetic").rank == RankConfig()
    for name in names:
        profile = load_profile(name)
        assert profile.name == name and profile.source and profile.description
    llama = load_profile("llama3.1-8b-h100").rank
    assert llama.chunked_prefill_size == 8192 and llama.kv_capacity == 420_000
    # 256 sequences of 1k tokens: 6.5 + 6.4 + 12.5 ms, as its comments work out
    assert llama.decode_step_s(256, 256 * 1000) == pytest.approx(0.025444)


def test_a_profile_file_is_read_with_its_units(tmp_path):
    path = tmp_path / "mine.profile"
    path.write_text(GOOD)
    rank = load_profile_file(path).rank
    assert rank == RankConfig(
        kv_capacity=50000,
        max_running=64,
        chunked_prefill_size=4096,
        prefill_base_s=5e-3,
        prefill_s_per_token=40e-6,
        decode_base_s=8e-3,
        decode_s_per_request=20e-6,
        decode_s_per_kv_token=30e-9,
    )


@pytest.mark.parametrize(
    "change, words",
    [
        (("decode_step_ms = 8", "decode_step_ms = fast"), "line 10: decode_step_ms = 'fast' is not a number"),
        (("max_running_requests = 64", "max_running_requests = 6.5"), "line 6: max_running_requests = '6.5' is not a whole"),
        (("source = made up", "source = made up\nturbo = 1"), "line 5: unknown key 'turbo'"),
        (("source = made up", "source = made up\nname = again"), "line 5: 'name' given twice (first on line 2)"),
        (("decode_kv_token_ns = 30", ""), "missing decode_kv_token_ns"),
        (("source = made up", "source made up"), "line 4: 'source made up' is not 'key = value'"),
        (("max_running_requests = 64", "max_running_requests = 0"), "max_running and max_prefill_tokens must be >= 1"),
    ],
)
def test_bad_profile_files_name_the_line_and_key(tmp_path, change, words):
    path = tmp_path / "bad.profile"
    path.write_text(GOOD.replace(*change))
    with pytest.raises(InvalidInputError) as err:
        load_profile_file(path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(InvalidInputError, match="unknown profile 'h100'.*llama3.1-8b-h100"):
        load_profile("h100")


def test_cli_takes_a_profile_file_and_its_overrides(tmp_path):
    path = tmp_path / "mine.profile"
    path.write_text(GOOD)
    proc = subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", "--trace", "steady", "--ranks", "2", "--duration", "1",
         "--profile-file", str(path), "--chunked-prefill-size", "0", "--methods", "round_robin"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "profile mine: KV 50000 tokens, max running 64, no chunked prefill" in proc.stdout

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


def test_dp_attention_and_slo_fields_and_their_defaults(tmp_path):
    path = tmp_path / "mine.profile"
    path.write_text(GOOD)
    plain = load_profile_file(path)
    assert not plain.dp_attention and plain.lockstep.moe_prefill_s_per_token == 0.0
    assert (plain.slo_ttft_s, plain.slo_tpot_s) == (1.0, 0.1)
    path.write_text(
        GOOD + "dp_attention = 1\nmoe_prefill_token_us = 25\nmoe_decode_token_us = 10\neager_decode_ms = 3\n"
        "slo_ttft_ms = 2500\nslo_tpot_ms = 80\n"
    )
    mine = load_profile_file(path)
    assert mine.dp_attention
    assert mine.lockstep.moe_prefill_s_per_token == pytest.approx(25e-6)
    assert mine.lockstep.moe_decode_s_per_token == pytest.approx(10e-6)
    assert mine.lockstep.eager_decode_s == pytest.approx(3e-3)
    assert plain.lockstep.idle_pass_s == mine.lockstep.idle_pass_s == pytest.approx(1e-3)  # the default
    path.write_text(GOOD + "dp_attention = 1\nidle_pass_ms = 0.25\n")
    assert load_profile_file(path).lockstep.idle_pass_s == pytest.approx(0.25e-3)
    assert (mine.slo_ttft_s, mine.slo_tpot_s) == pytest.approx((2.5, 0.08))
    deepseek = load_profile("deepseek-v3-dp-attention-h100")
    assert deepseek.dp_attention and deepseek.slo_tpot_s == pytest.approx(0.1)
    assert not load_profile("llama3.1-8b-h100").dp_attention and not load_profile("synthetic").dp_attention


@pytest.mark.parametrize(
    "extra, words",
    [
        ("dp_attention = 2\n", "dp_attention is 0 or 1"),
        ("moe_prefill_token_us = 50\n", "moe_prefill_token_us is part of prefill_token_us"),
        ("slo_tpot_ms = 0\n", "slo_ttft_ms and slo_tpot_ms must be > 0"),
    ],
)
def test_bad_lockstep_fields_are_named(tmp_path, extra, words):
    path = tmp_path / "bad.profile"
    path.write_text(GOOD + extra)
    with pytest.raises(InvalidInputError, match=words):
        load_profile_file(path)


def test_cli_dp_attention_follows_the_profile_unless_told(tmp_path):
    def header(*extra: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "dpboard.cli", "sim", "--trace", "steady", "--ranks", "2", "--duration", "0.5",
             "--load", "0.1", "--methods", "round_robin", *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "2 ranks stepping independently" in header()
    assert "2 ranks in lockstep (DP attention)" in header("--dp-attention")
    deepseek = header("--profile", "deepseek-v3-dp-attention-h100")
    assert "in lockstep (DP attention)" in deepseek and "TTFT 5000 ms, TPOT 100 ms" in deepseek
    assert "stepping independently" in header("--profile", "deepseek-v3-dp-attention-h100", "--no-dp-attention")
    assert "TPOT 40 ms" in header("--slo-tpot-ms", "40")

"""Trace files: the three formats, their errors (file, line, column), and shaping for a run.

Small files are written to tmp_path; the real traces are read from the checkout's traces/, else from
../shared/traces beside it, and their tests skip, naming both folders, when neither holds them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.sim.model import RankConfig
from dpboard.sim.profile import load_profile
from dpboard.sim.tracefile import (
    AZURE,
    BURSTGPT,
    MOONCAKE,
    parse_window,
    read_trace_file,
    shape_trace,
    spread_buckets,
)
from dpboard.sim.workload import offered_load, token_costs
from tests.support.real_traces import AZURE_NAME, MOONCAKE_NAME, PLACES, trace_dir
from tests.support.real_traces import needs_traces as needs_traces_in_checkout

TRACES = trace_dir() or PLACES[0]
AZURE_FILE = TRACES / AZURE_NAME
MOONCAKE_FILE = TRACES / MOONCAKE_NAME
needs_traces = needs_traces_in_checkout()

AZURE_TEXT = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:01.0000000,1200,7
"""

BURSTGPT_TEXT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
"""


def mooncake_lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 512, "output_length": 5, "hash_ids": [0]},
    {"timestamp": 6000, "input_length": 40, "output_length": 0, "hash_ids": [7]},
]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the three formats -----------------------------------------------------------------------------


def test_azure_csv_is_recognised_and_read(tmp_path):
    tf = read_trace_file(write(tmp_path, "a.csv", AZURE_TEXT))
    assert tf.format == AZURE and not tf.bucketed and tf.blocks is None
    assert tf.prompt_len.tolist() == [374, 396, 1200]
    assert tf.output_len.tolist() == [44, 109, 7]
    # absolute times become seconds from the first request, to the 100 ns the file has
    assert tf.arrival_s == pytest.approx([0.0, 4.314579, 14.31941], abs=1e-6)


def test_burstgpt_csv_is_recognised_and_zero_outputs_run_as_one(tmp_path):
    tf = read_trace_file(write(tmp_path, "b.csv", BURSTGPT_TEXT))
    assert tf.format == BURSTGPT
    assert tf.arrival_s.tolist() == [0.0, 40.0, 113.0]
    assert tf.prompt_len.tolist() == [472, 1087, 417]
    assert tf.output_len.tolist() == [18, 1, 276]
    assert tf.zero_output.tolist() == [False, True, False]


def test_mooncake_jsonl_is_recognised_with_its_block_ids(tmp_path):
    tf = read_trace_file(write(tmp_path, "m.jsonl", mooncake_lines(MOONCAKE_ROWS)))
    assert tf.format == MOONCAKE and tf.bucketed
    assert tf.arrival_s.tolist() == [0.0, 0.0, 3.0, 6.0]
    assert tf.blocks is not None
    assert tf.blocks.rows() == [(0, 1), (0, 1, 2), (0,), (7,)]
    assert tf.output_len.tolist() == [10, 20, 5, 1]


def test_rows_out_of_time_order_are_sorted_with_their_blocks(tmp_path):
    rows = [dict(MOONCAKE_ROWS[2]), dict(MOONCAKE_ROWS[0])]
    tf = read_trace_file(write(tmp_path, "m.jsonl", mooncake_lines(rows)))
    assert tf.arrival_s.tolist() == [0.0, 3.0]
    assert tf.blocks.rows() == [(0, 1), (0,)]
    assert tf.prompt_len.tolist() == [1000, 512]


# -- errors: the file, the line, the column ----------------------------------------------------


@pytest.mark.parametrize(
    "text, line, column, words",
    [
        (AZURE_TEXT + "2023-11-16 18:16:02.5,12x,3\n", 5, "column 2 (ContextTokens)", "'12x' is not a whole number"),
        (AZURE_TEXT + "yesterday,12,3\n", 5, "column 1 (TIMESTAMP)", "not a time like"),
        (AZURE_TEXT + "2023-02-30 10:00:00,12,3\n", 5, "column 1 (TIMESTAMP)", "day is out of range"),
        (AZURE_TEXT + "2023-11-16 18:16:02.5,12\n", 5, "column 3 (GeneratedTokens)", "missing"),
        (AZURE_TEXT + "2023-11-16 18:16:02.5,0,3\n", 5, "column 2 (ContextTokens)", "must be >= 1"),
        (AZURE_TEXT + "2023-11-16 18:16:02.5,5,-3\n", 5, "column 3 (GeneratedTokens)", "not a whole number"),
        (BURSTGPT_TEXT + "soon,ChatGPT,1,2,3,API log\n", 5, "column 1 (Timestamp)", "not a time in seconds"),
        (BURSTGPT_TEXT + "200,ChatGPT,1.5,2,3,API log\n", 5, "column 3 (Request tokens)", "not a whole number"),
        (BURSTGPT_TEXT + "200,ChatGPT,10,two,12,API log\n", 5, "column 4 (Response tokens)", "not a whole number"),
        (BURSTGPT_TEXT + "200,ChatGPT,10,2,12,API log,extra\n", 5, "column 7", "unexpected extra value"),
    ],
)
def test_bad_csv_rows_name_line_and_column(tmp_path, text, line, column, words):
    """Azure's and BurstGPT's CSV alike."""
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(InvalidInputError) as err:
        read_trace_file(path)
    message = str(err.value)
    assert str(path) in message and f"line {line}" in message and column in message and words in message


@pytest.mark.parametrize(
    "bad_line, column, words",
    [
        ('{"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": [3]', "column 76", "not valid JSON"),
        ('{"timestamp": 9000, "input_length": "ten", "output_length": 1, "hash_ids": [3]}', "column 'input_length'", "not a whole number"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [3]}', "column 'timestamp'", "milliseconds >= 0"),
        ('{"timestamp": 9000, "input_length": 10, "hash_ids": [3]}', "column 'output_length'", "missing"),
        ('{"timestamp": 9000, "input_length": 1100, "output_length": 1, "hash_ids": [3, 4]}', "column 'hash_ids'", "needs 3"),
        ('{"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": ["x"]}', "column 'hash_ids'", "list of block ids"),
        ('{"timestamp": 9000, "input_length": 10, "output_length": 1}', "column 'hash_ids'", "every line must match"),
        ("[1, 2, 3]", "column 1", "expected a JSON object"),
    ],
)
def test_bad_mooncake_lines_name_line_and_column(tmp_path, bad_line, column, words):
    path = write(tmp_path, "bad.jsonl", mooncake_lines(MOONCAKE_ROWS) + "\n" + bad_line + "\n")
    with pytest.raises(InvalidInputError) as err:
        read_trace_file(path)
    message = str(err.value)
    # four good lines and a blank one before it: the bad one is line 6
    assert str(path) in message and "line 6" in message and column in message and words in message


def test_files_of_no_known_format_say_what_is_expected(tmp_path):
    with pytest.raises(InvalidInputError, match=r"line 1: header 'time,prompt,output' is not a trace format .*Azure CSV"):
        read_trace_file(write(tmp_path, "x.csv", "time,prompt,output\n1,2,3\n"))
    with pytest.raises(InvalidInputError, match=r"line 1: a JSON object without the Mooncake keys .* \(it has t, n\)"):
        read_trace_file(write(tmp_path, "x.jsonl", '{"t": 1, "n": 2}\n'))
    with pytest.raises(InvalidInputError, match="is empty"):
        read_trace_file(write(tmp_path, "empty.csv", "\n\n"))
    with pytest.raises(InvalidInputError, match="header but no requests"):
        read_trace_file(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(NotFoundError, match="does not exist"):
        read_trace_file(tmp_path / "nowhere.csv")
    with pytest.raises(InvalidInputError, match="not UTF-8"):
        (tmp_path / "z.csv.gz").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe")
        read_trace_file(tmp_path / "z.csv.gz")


def test_a_bad_file_runs_nothing(tmp_path):
    path = write(tmp_path, "bad.csv", AZURE_TEXT + "2023-11-16 18:16:02.5,12x,3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", "--trace-file", str(path), "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""  # no table: nothing was simulated
    assert f"{path}, line 5, column 2 (ContextTokens)" in proc.stderr


# -- shaping: spread, window, load ---------------------------------------------------------------


def test_spread_keeps_each_request_in_its_bucket_and_is_seeded():
    times = np.array([0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0, 6.0])
    a = spread_buckets(times, np.random.default_rng(4))
    b = spread_buckets(times, np.random.default_rng(4))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, spread_buckets(times, np.random.default_rng(5)))
    assert np.all(a >= times) and np.all(a < times + 3.0)
    assert len(set(a.tolist())) == times.size  # the lumps are gone


def test_window_and_no_spread(tmp_path):
    tf = read_trace_file(write(tmp_path, "m.jsonl", mooncake_lines(MOONCAKE_ROWS)))
    rank = RankConfig()
    kept = shape_trace(tf, n_ranks=2, seed=0, rank=rank, spread=False)
    assert kept.arrival_s.tolist() == [0.0, 0.0, 3.0, 6.0] and not kept.info["spread"]
    window = shape_trace(tf, n_ranks=2, seed=0, rank=rank, spread=False, window=parse_window("3:6"))
    assert window.arrival_s.tolist() == [0.0] and window.block_rows() == [(0,)]
    tail = shape_trace(tf, n_ranks=2, seed=0, rank=rank, spread=False, window=parse_window("2:"))
    assert tail.arrival_s.tolist() == [1.0, 4.0] and tail.info["zero_outputs_run_as_1"] == 1
    with pytest.raises(InvalidInputError, match="holds no request"):
        shape_trace(tf, n_ranks=2, seed=0, rank=rank, window=parse_window("100:200"))
    for bad in ("10", "a:b", "5:5", "-1:4"):
        with pytest.raises(InvalidInputError, match="--window"):
            parse_window(bad)


def test_load_scales_arrival_times_not_lengths(tmp_path):
    tf = read_trace_file(write(tmp_path, "a.csv", AZURE_TEXT))
    rank = load_profile("llama3.1-8b-h100").rank
    plain = shape_trace(tf, n_ranks=4, seed=0, rank=rank)
    loaded = shape_trace(tf, n_ranks=4, seed=0, rank=rank, load=0.5)
    assert np.array_equal(loaded.prompt_len, plain.prompt_len)
    assert np.array_equal(loaded.output_len, plain.output_len)
    scale = loaded.info["time_scale"]
    assert loaded.arrival_s == pytest.approx(plain.arrival_s * scale)
    assert offered_load(loaded.prompt_len, loaded.output_len, float(loaded.arrival_s[-1]), 4, rank) == pytest.approx(0.5)
    assert loaded.info["load"] == pytest.approx(0.5)
    # and the load is what the capacity rule says, worked by hand: prefill 32 us + 6.5 ms / 8192 per
    # prompt token; decode at batch min(2048, 420000 // (656.67 + 26.67)) = 614
    costs = token_costs(rank, plain.prompt_len, plain.output_len)
    assert costs.decode_batch == 614
    assert costs.prefill_s == pytest.approx(32e-6 + 6.5e-3 / 8192)
    held = 1970 / 3 + 160 / 3 / 2
    assert costs.decode_s == pytest.approx((6.5e-3 + 25e-6 * 614 + 49e-9 * 614 * held) / 614)
    work = 1970 * costs.prefill_s + (43 + 108 + 6) * costs.decode_s
    assert plain.info["natural_load"] == pytest.approx(work / (4 * plain.arrival_s[-1]))
    with pytest.raises(InvalidInputError, match="--load must be > 0"):
        shape_trace(tf, n_ranks=4, seed=0, rank=rank, load=0)


# -- the real traces -------------------------------------------------------------------------------


@needs_traces
def test_real_traces_read_as_their_readme_says():
    azure = read_trace_file(AZURE_FILE)
    assert azure.format == AZURE and len(azure) == 19366
    assert azure.arrival_s[-1] == pytest.approx(3502, abs=1)
    assert np.percentile(azure.prompt_len, 50) == pytest.approx(1020, abs=1)
    mooncake = read_trace_file(MOONCAKE_FILE)
    assert mooncake.format == MOONCAKE and len(mooncake) == 12031
    assert np.percentile(mooncake.prompt_len, 99) == pytest.approx(85400, rel=0.01)
    ids = mooncake.blocks.ids
    # "36.6 % of prompt blocks repeat an earlier block"
    _, first = np.unique(ids, return_index=True)
    assert 1 - first.size / ids.size == pytest.approx(0.366, abs=0.001)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", *args], capture_output=True, text=True, timeout=300
    )


def without_wall_clock(doc: dict) -> dict:
    for run in doc["runs"]:
        run["summary"].pop("wall_s")
    return doc


@needs_traces
@pytest.mark.parametrize(
    "trace, window",
    [(AZURE_FILE, "0:900"), (MOONCAKE_FILE, "0:600")],
)
def test_real_trace_runs_are_deterministic(tmp_path, trace, window):
    docs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        proc = run_cli(
            "--trace-file", str(trace), "--window", window, "--ranks", "8", "--load", "0.8",
            "--methods", "total_tokens,vllm,cache_aware,dynamo_kv,inflight_backlog,inflight_cache", "--json", str(out),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        docs.append(without_wall_clock(json.loads(out.read_text())))
    assert docs[0] == docs[1]
    doc = docs[0]
    assert doc["trace"]["file"]["load"] == pytest.approx(0.8)
    assert doc["profile"]["name"] == "llama3.1-8b-h100"
    hits = {run["summary"]["method"]: run["summary"]["cache_hit_rate"] for run in doc["runs"]}
    if trace == MOONCAKE_FILE:
        # the prefix caches serve some prompt tokens, and the cache-aware routers find more of them
        assert 0 < hits["total_tokens"] < hits["cache_aware"]
        assert hits["total_tokens"] < hits["dynamo_kv"]
        assert hits["total_tokens"] < hits["inflight_cache"]
    else:
        assert set(hits.values()) == {0.0}  # no block ids, no reuse


def test_cli_options_that_do_not_fit_the_source_are_refused(tmp_path):
    path = write(tmp_path, "a.csv", AZURE_TEXT)
    proc = run_cli("--trace-file", str(path), "--duration", "5")
    assert proc.returncode == 2 and "--window START:END" in proc.stderr
    proc = run_cli("--trace", "steady", "--window", "0:5")
    assert proc.returncode == 2 and "--trace-file only" in proc.stderr
    proc = run_cli("--trace-file", str(path), "--trace", "steady")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
    proc = run_cli("--trace-file", str(path), "--ranks", "2", "--profile", "synthetic", "--methods", "round_robin")
    assert proc.returncode == 0, proc.stderr
    assert "(Azure LLM inference trace (CSV)): 3 of 3 requests" in proc.stdout
    assert "profile synthetic" in proc.stdout


# -- hostile files: one line naming line and column, never a traceback ------------------------------

_HUGE = "9" * 4400


@pytest.mark.parametrize(("name", "text", "words"), [
    ("field.csv", AZURE_TEXT + "2023-11-16 18:16:02.5," + "7" * 200_000 + ",3\n",
     "line 5, column 2: not a CSV row this reader takes (field larger than field limit"),
    ("digits.csv", AZURE_TEXT + f"2023-11-16 18:16:02.5,{_HUGE},3\n",
     "line 5, column 2 (ContextTokens): 99999999999999999999...9999999999 (4400 characters) tokens: more than"),
    ("wide.csv", AZURE_TEXT + f"2023-11-16 18:16:02.5,12,{2**63}\n",
     "line 5, column 3 (GeneratedTokens): "),
    ("burst.csv", BURSTGPT_TEXT + f"200,GPT-4,{2**63 - 1},3,9,API log\n",
     "line 5, column 3 (Request tokens): 9223372036854775807 tokens: more than the 4294967296"),
    ("digits.jsonl", mooncake_lines(MOONCAKE_ROWS) + f'{{"timestamp": 1, "input_length": {_HUGE}, '
                                                      f'"output_length": 1}}\n', "line 5, column 1: not a JSON value"),
    ("tokens.jsonl", mooncake_lines(MOONCAKE_ROWS[:1]) + json.dumps(
        {"timestamp": 1, "input_length": 2**63 - 1, "output_length": 1, "hash_ids": [0]}) + "\n",
     "line 2, column 'input_length': 9223372036854775807 tokens: more than the 4294967296"),
    ("ids.jsonl", mooncake_lines(MOONCAKE_ROWS[:1]) + json.dumps(
        {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [2**63]}) + "\n",
     "line 2, column 'hash_ids': expected a list of block ids (whole numbers in [0, 9223372036854775807])"),
    ("deep.jsonl", mooncake_lines(MOONCAKE_ROWS[:1]) + '{"timestamp": 1, "x": ' + "[" * 100_000 + "]" * 100_000
     + "}\n", "line 2, column 1: JSON nested too deeply"),
])
def test_a_hostile_trace_file_is_one_line_naming_line_and_column(tmp_path, name, text, words):
    """Each of these once ended in a traceback (csv's 128 KiB field limit, int()'s 4,300 digits,
    int64 overflow of token counts or block ids, Python's recursion limit), and input_length
    2**63-1 wrapped the simulator's KV-fit check into a RuntimeError after 3 s."""
    path = write(tmp_path, name, text)
    proc = run_cli("--trace-file", str(path), "--ranks", "2")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert f"{path}, {words}" in proc.stderr, proc.stderr


def test_reading_a_large_file_takes_about_twice_its_size(tmp_path):
    """A 50 MB CSV once peaked at 492 MB (the whole text, its lines, and a Python int per value).
    Read line by line into 8-byte arrays now: the peak stays within 3x the file (measured in a
    child process of its own, by its peak RSS over what the interpreter and imports took)."""
    rows = 600_000
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
        for i in range(rows):
            f.write(f"{i * 0.01:.2f},ChatGPT,{100 + i % 900},{i % 300},{100 + i % 900 + i % 300},Conversation log\n")
    size_mb = path.stat().st_size / 2**20
    probe = f"""
import resource
from dpboard.sim.tracefile import read_trace_file
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tf = read_trace_file({str(path)!r})
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(tf), (after - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    n, grown_mb = out.stdout.split()
    assert int(n) == rows
    assert float(grown_mb) < 3 * size_mb, f"reading {size_mb:.0f} MB took {float(grown_mb):.0f} MB more"

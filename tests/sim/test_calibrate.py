"""``fit_profile``: the rank model's terms fitted back from steps, and a log it cannot fit refused.

The steps come from the simulator's own ``RankModel`` run with known terms (chunked prefill, a
growing decode batch, KV that grows as sequences do), then spoiled as a shared CPU spoils a real
server's: every step a few % off, and one in ten stalled by 0.2-0.8 s. The fit must find the known
terms through that, and the profile it writes must run in ``dpboard sim`` as the original does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.calibrate import StepTable, fit_profile
from dpboard.sim.model import DECODE, PREFILL, RankConfig, RankModel, SimRequest
from dpboard.sim.profile import load_profile_file

TRUE = RankConfig(kv_capacity=200_000, max_running=64, chunked_prefill_size=1024, prefill_base_s=0.004,
                  prefill_s_per_token=30e-6, decode_base_s=0.005, decode_s_per_request=0.002,
                  decode_s_per_kv_token=50e-9).validate()
HEADER = {"chunked_prefill_size": 1024, "max_running_requests": 64, "max_total_tokens": 200_000}


def simulated_steps(config: RankConfig = TRUE, n_steps: int = 3000, seed: int = 0) -> StepTable:
    """A rank's steps under random arrivals: what a step log of that rank holds."""
    rank = RankModel(0, config)
    rng = np.random.default_rng(seed)
    now, rid, rows = 0.0, 0, []
    for _ in range(n_steps):
        while rng.random() < 0.15:
            rank.receive(SimRequest(rid, now, int(rng.integers(20, 3000)), int(rng.integers(5, 200))), now)
            rid += 1
        took = rank.begin_step(now)
        if took is None:
            now += 0.01
            continue
        if rank.state == PREFILL:
            rows.append(("extend", rank.step_tokens, 0, 0, took, rank.after_prefill))
        else:
            assert rank.state == DECODE
            rows.append(("decode", 0, rank.step_tokens, rank.step_kv_tokens, took, rank.after_prefill))
        now += took
        rank.end_step(now)
    mode, tokens, reqs, ctx, took, after = (np.array(col) for col in zip(*rows, strict=True))
    return StepTable(mode, tokens, reqs, ctx, np.zeros(len(mode), bool), took.astype(float), after_prefill=after)


def spoiled(table: StepTable, seed: int = 1) -> StepTable:
    rng = np.random.default_rng(seed)
    n = len(table.mode)
    took = table.duration_s * (1 + 0.05 * rng.standard_normal(n)) + (rng.random(n) < 0.1) * rng.uniform(0.2, 0.8, n)
    return dataclasses.replace(table, duration_s=took)


def test_the_terms_come_back_from_clean_steps():
    fit = fit_profile(simulated_steps(), HEADER)
    assert fit.value("prefill_step_ms") == pytest.approx(4.0, rel=1e-3)
    assert fit.value("prefill_token_us") == pytest.approx(30.0, rel=1e-3)
    assert fit.value("decode_step_ms") == pytest.approx(5.0, rel=1e-3)
    assert fit.value("decode_request_us") == pytest.approx(2000.0, rel=1e-3)
    assert fit.value("decode_kv_token_ns") == pytest.approx(50.0, rel=1e-2)
    assert fit.error["prefill"][1] < 0.1 and fit.error["decode"][1] < 0.1  # p90 % error


def test_stalls_do_not_pull_the_median_fit():
    """One step in ten 0.2-0.8 s late: a least-squares fit adds tens of ms to every step."""
    fit = fit_profile(spoiled(simulated_steps()), HEADER, fit="median")
    assert fit.value("prefill_token_us") == pytest.approx(30.0, rel=0.1)
    assert fit.value("decode_request_us") == pytest.approx(2000.0, rel=0.1)
    assert fit.value("decode_step_ms") == pytest.approx(5.0, abs=1.5)
    med, p90 = fit.error["decode"]
    assert med < 10 < p90  # the typical step fitted; the stalls are what the p90 shows
    table = spoiled(simulated_steps())
    dec = table.mode == "decode"
    x = np.column_stack([np.ones(dec.sum()), table.decode_reqs[dec], table.decode_ctx_tokens[dec]])
    least_squares, *_ = np.linalg.lstsq(x, table.duration_s[dec], rcond=None)
    assert least_squares[0] * 1e3 > 5.0 + 10  # what the robust fit is for


def test_the_mean_fit_keeps_the_time_the_steps_took_and_the_default_keeps_it_for_decode():
    """``mean``: stalled steps' time is spread over the steps of their kind, so a sum of modelled
    steps (a request's decode, a busy stretch) is the sum of the recorded ones. The default
    (``request``) does so for decode steps (a TPOT is the mean of many) and takes the median
    prefill step (a first token waits on one)."""
    table = spoiled(simulated_steps())
    mean = fit_profile(table, HEADER, fit="mean")
    median = fit_profile(table, HEADER, fit="median")
    default = fit_profile(table, HEADER)
    assert default.fit == "request" and "decode by its mean step" in default.profile_text("x", "y")
    for kind, mode in (("prefill", "extend"), ("decode", "decode")):
        rows = table.mode == mode
        recorded = float(table.duration_s[rows].sum())
        assert _modelled(mean, table, rows).sum() == pytest.approx(recorded, rel=1e-6), kind
        assert _modelled(median, table, rows).sum() < 0.8 * recorded, kind  # the median leaves the stalls out
    dec, pre = table.mode == "decode", table.mode == "extend"
    assert _modelled(default, table, dec).sum() == pytest.approx(float(table.duration_s[dec].sum()), rel=1e-6)
    assert default.value("prefill_token_us") == pytest.approx(median.value("prefill_token_us"))
    assert _modelled(default, table, pre).sum() < 0.8 * float(table.duration_s[pre].sum())
    with pytest.raises(InvalidInputError, match="fit 'mode' is not one of request, mean, median"):
        fit_profile(table, HEADER, fit="mode")


def _modelled(fit, table: StepTable, rows: np.ndarray) -> np.ndarray:
    if (table.mode[rows] == "extend").all():
        return fit.value("prefill_step_ms") * 1e-3 + fit.value("prefill_token_us") * 1e-6 * table.prefill_tokens[rows]
    return (fit.value("decode_step_ms") * 1e-3 + fit.value("decode_request_us") * 1e-6 * table.decode_reqs[rows]
            + fit.value("decode_kv_token_ns") * 1e-9 * table.decode_ctx_tokens[rows]
            + fit.value("decode_after_prefill_ms") * 1e-3 * table.after_prefill[rows])


def test_the_profile_written_runs_in_the_simulator_as_the_original(tmp_path):
    fit = fit_profile(simulated_steps(), HEADER)
    path = tmp_path / "fitted.profile"
    path.write_text(fit.profile_text("fitted", "a simulated rank"))
    profile = load_profile_file(path)
    assert profile.rank.kv_capacity == 200_000 and profile.rank.max_running == 64
    assert profile.rank.chunked_prefill_size == 1024
    assert profile.rank.prefill_s_per_token == pytest.approx(TRUE.prefill_s_per_token, rel=1e-3)
    assert profile.rank.decode_step_s(16, 10_000) == pytest.approx(TRUE.decode_step_s(16, 10_000), rel=1e-3)


def test_a_term_the_log_cannot_pin_is_named():
    """Every decode request's context grows alike: with KV always 400 x batch, the KV term and the
    per-request term cannot be told apart."""
    table = simulated_steps()
    ctx = np.where(table.mode == "decode", table.decode_reqs * 400, 0)
    fit = fit_profile(dataclasses.replace(table, decode_ctx_tokens=ctx), HEADER)
    assert "decode_kv_token_ns" in fit.loose
    assert "decode_kv_token_ns" in fit.report().splitlines()[-1]


def test_too_few_steps_are_refused_with_what_is_missing():
    table = simulated_steps(n_steps=40)
    with pytest.raises(InvalidInputError, match=r"the fit needs at least 30: record longer"):
        fit_profile(table, HEADER)


def test_one_prompt_length_is_refused():
    table = simulated_steps()
    tokens = np.where(table.mode == "extend", 512, 0)
    with pytest.raises(InvalidInputError, match=r"prefill steps have 1 distinct prompt-token counts.*several lengths"):
        fit_profile(dataclasses.replace(table, prefill_tokens=tokens), HEADER)


def test_a_header_without_the_capacities_is_refused():
    with pytest.raises(InvalidInputError, match=r"header has no usable max_total_tokens"):
        fit_profile(simulated_steps(), {"chunked_prefill_size": 1024, "max_running_requests": 64})


def test_dp_attention_decodes_in_an_extend_step_give_eager_decode():
    """Under DP attention a rank decoding in a step where another rank extends runs the extend step
    (prefill's base) with its own decode batch, 3 ms dearer: the fit gives the 3 ms back over that base,
    and the fitted profile's lockstep step beside a short prefill lasts what the log recorded."""
    from dpboard.sim.stepping import LockstepCost, RankGroup

    table = simulated_steps()
    rng = np.random.default_rng(2)
    group_extend = (table.mode == "decode") & ~table.after_prefill & (rng.random(len(table.mode)) < 0.3)
    in_extend = (TRUE.prefill_base_s + TRUE.decode_s_per_request * table.decode_reqs
                 + TRUE.decode_s_per_kv_token * table.decode_ctx_tokens + 0.003)
    took = np.where(group_extend, in_extend, table.duration_s)
    fit = fit_profile(dataclasses.replace(table, group_extend=group_extend, duration_s=took),
                      {**HEADER, "dp_attention": True})
    assert fit.value("eager_decode_ms") == pytest.approx(3.0, rel=0.02)
    assert fit.value("decode_step_ms") == pytest.approx(5.0, rel=1e-2)
    assert "dp_attention = 1" in fit.profile_text("x", "y")

    config = dataclasses.replace(TRUE, prefill_base_s=fit.value("prefill_step_ms") * 1e-3,
                                 prefill_s_per_token=fit.value("prefill_token_us") * 1e-6,
                                 decode_base_s=fit.value("decode_step_ms") * 1e-3,
                                 decode_s_per_request=fit.value("decode_request_us") * 1e-6,
                                 decode_s_per_kv_token=fit.value("decode_kv_token_ns") * 1e-9).validate()
    decoding, prefilling = RankModel(0, config), RankModel(1, config)
    group = RankGroup(0, [decoding, prefilling], LockstepCost(eager_decode_s=fit.value("eager_decode_ms") * 1e-3))
    for i in range(4):
        decoding.receive(SimRequest(i, 0.0, 10, 50), 0.0)
    now = 0.0
    for _ in range(3):  # the four prompts prefilled, then decoding
        now += group.begin(now)
        group.end(now)
    prefilling.receive(SimRequest(9, now, 20, 5), now)
    took_s = group.begin(now)
    assert decoding.state == DECODE and prefilling.state == PREFILL
    recorded = (TRUE.prefill_base_s + TRUE.decode_s_per_request * 4 + TRUE.decode_s_per_kv_token * decoding.step_kv_tokens
                + 0.003)
    assert took_s == pytest.approx(recorded, rel=0.02)


def write_step_log(directory, table: StepTable, rank: int, settings: dict) -> None:
    """``table`` as a scheduler's step log, through the recorder's own writer (back to back steps)."""
    from dpboard.steplog import format as fmt
    from dpboard.steplog.writer import StepLog

    log = StepLog(directory, engine="sglang", rank=rank, header={"settings": settings}, max_bytes=1 << 24,
                  at_exit=False)
    codes = {"extend": fmt.EXTEND, "decode": fmt.DECODE}
    t = 0
    for i in range(len(table.mode)):
        took = int(table.duration_s[i] * 1e9)
        log.record(t, took, i, 0, int(table.decode_ctx_tokens[i]), int(table.prefill_tokens[i]),
                   int(table.mode[i] == "extend"), int(table.decode_reqs[i]), int(table.decode_reqs[i]),
                   max(1, int(table.decode_reqs[i])), codes[table.mode[i]])
        t += took
    log.close()


def test_dpboard_calibrate_reads_step_logs_and_writes_a_profile_sim_runs(tmp_path):
    """Two ranks' logs in a directory -> `dpboard calibrate` -> a profile `dpboard sim` runs a trace on."""
    import subprocess
    import sys

    from tests.support.names import ROOT

    settings = {**HEADER, "overlap": False, "dp_attention": False, "method": "total_tokens"}
    for rank in range(2):
        write_step_log(tmp_path, simulated_steps(seed=rank), rank, settings)
    out = tmp_path / "fitted.profile"
    done = subprocess.run([sys.executable, "-m", "dpboard", "calibrate", str(tmp_path), "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not pinned down by this log: none" in done.stdout
    profile = load_profile_file(out)
    assert profile.rank.decode_s_per_request == pytest.approx(TRUE.decode_s_per_request, rel=1e-2)
    sim = subprocess.run([sys.executable, "-m", "dpboard", "sim", "--profile-file", str(out), "--ranks", "2",
                          "--quick", "--methods", "round_robin,total_tokens"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    assert "total_tokens" in sim.stdout


def test_dpboard_calibrate_refuses_logs_of_two_setups(tmp_path):
    import subprocess
    import sys

    from tests.support.names import ROOT

    write_step_log(tmp_path, simulated_steps(), 0, {**HEADER, "overlap": False, "dp_attention": False})
    write_step_log(tmp_path, simulated_steps(), 1, {**HEADER, "overlap": True, "dp_attention": False})
    done = subprocess.run([sys.executable, "-m", "dpboard", "calibrate", str(tmp_path), "-o", str(tmp_path / "p")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "set up otherwise than the first (overlap False vs True): fit each setup on its own" in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback


# -- the front-end path: what a step log cannot see -------------------------------------------------


def _lone_ttfts(rank: RankConfig, prompts: np.ndarray, frontend_s: float) -> np.ndarray:
    """The first token of each request sent alone to an idle server whose path outside the
    scheduler takes ``frontend_s``: a prefill step of its prompt, then the path (computed from the
    step formula, not from the simulator)."""
    steps = np.ceil(prompts / rank.chunked_prefill_size)
    return steps * rank.prefill_base_s + prompts * rank.prefill_s_per_token + frontend_s


def test_the_front_end_comes_back_from_lone_requests_and_shifts_every_ttft_in_sim(tmp_path):
    from dpboard.sim.calibrate import fit_frontend
    from dpboard.sim.simulation import SimConfig, Simulation
    from dpboard.sim.trace import Trace

    rng = np.random.default_rng(3)
    prompts = rng.integers(20, 900, 40)
    outputs = np.full(40, 8)
    seen = _lone_ttfts(TRUE, prompts, 0.0123) + rng.normal(0, 0.0005, 40)
    median, p10, p90 = fit_frontend(prompts, outputs, seen, TRUE, overlap=False)
    # what the simulator lacks: the path less the controller-to-rank transit it already has
    assert median == pytest.approx(0.0123 - SimConfig().send_delay_s, abs=3e-4) and p10 < median < p90

    fit = fit_profile(simulated_steps(), HEADER)
    path = tmp_path / "fitted.profile"
    path.write_text(fit.profile_text("fitted", "a simulated rank", frontend_ms=median * 1e3, frontend_source="lone requests"))
    profile = load_profile_file(path)
    assert profile.frontend_s == pytest.approx(median, rel=1e-5)
    trace = Trace(name="t", n_ranks=2, seed=0, arrival_s=np.arange(50) * 0.05, prompt_len=np.resize(prompts, 50),
                  output_len=np.full(50, 20), is_burst=np.zeros(50, bool))
    runs = {}
    for frontend in (0.0, profile.frontend_s):
        config = SimConfig(n_ranks=2, rank=profile.rank, frontend_s=frontend).validate()
        runs[frontend] = Simulation(trace, "total_tokens", config).run().requests
    without, with_ = runs[0.0], runs[profile.frontend_s]
    for a, b in zip(without, with_, strict=True):  # the same schedule, seen later by the client
        assert b.rank == a.rank
        assert (b.first_token_s - b.arrival_s) - (a.first_token_s - a.arrival_s) == pytest.approx(profile.frontend_s)
        assert b.finished_s - b.first_token_s == pytest.approx(a.finished_s - a.first_token_s)


def test_a_front_end_fit_is_refused_on_too_few_requests_or_a_profile_slower_than_the_server():
    from dpboard.sim.calibrate import fit_frontend

    prompts = np.array([100, 200, 300, 400])
    with pytest.raises(InvalidInputError, match="5 or more lone requests"):
        fit_frontend(prompts, np.ones(4, int), _lone_ttfts(TRUE, prompts, 0.01), TRUE, overlap=False)
    prompts = np.array([100, 200, 300, 400, 500, 600])
    fast = _lone_ttfts(TRUE, prompts, 0.0) * 0.5  # the server prefills twice as fast as the profile says
    with pytest.raises(InvalidInputError, match="prices prefill above this server's"):
        fit_frontend(prompts, np.ones(6, int), fast, TRUE, overlap=False)
    with pytest.raises(InvalidInputError, match="front-end time must be >= 0"):
        from dpboard.sim.simulation import SimConfig
        SimConfig(n_ranks=1, rank=TRUE, frontend_s=-0.001).validate()


def test_dpboard_calibrate_writes_the_front_end_given_and_refuses_a_negative_one(tmp_path):
    import subprocess
    import sys

    from tests.support.names import ROOT

    write_step_log(tmp_path, simulated_steps(), 0, {**HEADER, "overlap": False, "dp_attention": False})
    out = tmp_path / "fitted.profile"
    args = [sys.executable, "-m", "dpboard", "calibrate", str(tmp_path), "-o", str(out)]
    done = subprocess.run([*args, "--frontend-ms", "14.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_profile_file(out).frontend_s == pytest.approx(0.0145)
    out.unlink()
    refused = subprocess.run([*args, "--frontend-ms", "-3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--frontend-ms: -3 is outside [0, 60000] milliseconds" in refused.stderr
    assert not out.exists()


def test_step_times_by_shape_put_the_recorded_beside_the_model():
    """Clean steps: the model's p50 per shape is the recorded one; stalled steps move the recorded
    p90 of every shape above the model's, and no shape is left out."""
    from dpboard.sim.calibrate import by_shape

    table = simulated_steps()
    fit = fit_profile(table, HEADER)
    rows = by_shape(table, fit)
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    assert sum(r["steps"] for r in rows) == int(((table.mode == "decode") | (table.mode == "extend")).sum())
    for r in rows:
        assert r["model_p50_ms"] == pytest.approx(r["real_p50_ms"], rel=0.02), r
    stalled = spoiled(table, seed=4)
    for r in by_shape(stalled, fit_profile(stalled, HEADER, fit="median")):
        if r["steps"] >= 50:
            assert r["real_p90_ms"] > r["model_p90_ms"], r


def test_attention_over_the_context_comes_back_from_steps_with_cached_prefixes():
    """Prefill steps of one request each, n new tokens after p cached: the step takes 4 ms + 30 us a
    token + 20 ns for each of the n * p + n * n / 2 pairs of a token computed and one it attends to.
    A fit without the pairs would price every long or cached prompt too low."""
    rng = np.random.default_rng(5)
    n_pre = 400
    new = rng.integers(16, 2000, n_pre).astype(float)
    cached = rng.choice([0, 512, 1024], n_pre).astype(float)
    took_pre = 0.004 + 30e-6 * new + 20e-9 * (new * cached + new * new / 2)
    base = simulated_steps()
    dec = base.mode == "decode"
    table = StepTable(
        mode=np.concatenate([np.full(n_pre, "extend"), base.mode[dec]]),
        prefill_tokens=np.concatenate([new, np.zeros(dec.sum())]),
        decode_reqs=np.concatenate([np.zeros(n_pre), base.decode_reqs[dec]]),
        decode_ctx_tokens=np.concatenate([np.zeros(n_pre), base.decode_ctx_tokens[dec]]),
        group_extend=np.zeros(n_pre + dec.sum(), bool),
        duration_s=np.concatenate([took_pre, base.duration_s[dec]]),
        prefix_tokens=np.concatenate([cached, np.zeros(dec.sum())]),
        prefill_reqs=np.concatenate([np.ones(n_pre), np.zeros(dec.sum())]),
    )
    fit = fit_profile(table, HEADER)
    assert fit.value("prefill_attention_ps") == pytest.approx(20_000, rel=1e-6)
    assert fit.value("prefill_token_us") == pytest.approx(30, rel=1e-6)
    assert fit.value("prefill_step_ms") == pytest.approx(4, rel=1e-6)
    assert "prefill_attention_ps" not in fit.loose
    # the simulator's rank prices a chunked prompt's pairs as the whole prompt's: 100 tokens in two
    # chunks of 50 are 50 * 25 + 50 * (50 + 25) = 100 * 100 / 2 pairs
    rank = RankModel(0, dataclasses.replace(TRUE, chunked_prefill_size=50, prefill_s_per_attention_pair=20e-9))
    rank.receive(SimRequest(0, 0.0, 100, 2), 0.0)
    first = rank.begin_step(0.0)
    rank.end_step(first)
    second = rank.begin_step(first)
    assert first == pytest.approx(0.004 + 50 * 30e-6 + 20e-9 * 50 * 25)
    assert second == pytest.approx(0.004 + 50 * 30e-6 + 20e-9 * 50 * 75)


@pytest.mark.parametrize("launch_share, sync", [(0.9, True), (0.02, False), (None, None)])
def test_launch_times_say_whether_the_forward_ran_in_the_schedulers_thread(tmp_path, launch_share, sync):
    """run_batch taking most of every step (a CPU computes in it) gives the profile sync_forward = 1,
    which the simulator reads; a device's launch, a sliver of the step, gives nothing; a log without
    launch times says nothing either way."""
    table = simulated_steps()
    if launch_share is not None:
        table = dataclasses.replace(table, launch_s=table.duration_s * launch_share)
    fit = fit_profile(table, HEADER)
    assert fit.sync_forward is sync
    path = tmp_path / "fitted.profile"
    path.write_text(fit.profile_text("fitted", "a simulated rank"))
    assert load_profile_file(path).rank.sync_forward is bool(sync)
    assert ("sync_forward" in fit.report()) is bool(sync)


def test_the_decode_step_after_a_prefill_comes_back_as_its_own_term():
    """A rank whose first decode after each prefill takes 2 ms more: the fit names it, the other decode
    terms stay the rank's own, and a rank without it gets 0, pinned."""
    slower = dataclasses.replace(TRUE, decode_after_prefill_s=0.002)
    fit = fit_profile(simulated_steps(slower), HEADER)
    assert fit.value("decode_after_prefill_ms") == pytest.approx(2.0, rel=1e-3)
    assert fit.value("decode_step_ms") == pytest.approx(5.0, rel=1e-3)
    assert "decode_after_prefill_ms" not in fit.loose
    plain = fit_profile(simulated_steps(), HEADER)
    assert plain.value("decode_after_prefill_ms") == pytest.approx(0.0, abs=1e-6)
    assert "decode_after_prefill_ms" not in plain.loose
    path_text = fit.profile_text("x", "y")
    assert "decode_after_prefill_ms = 2" in path_text


def test_where_a_result_comes_out_in_the_next_step_is_read_from_the_log(tmp_path):
    """CPU-like overlapped steps through the recorder's writer: a step every 10 ms, its forward (run_batch)
    7.5 ms of it, and each step's result processed 8 ms into the next step (SGLang's overlap loop on a
    CPU: launch k+1, which computes, then process k, then the loop's turn). The fit says the forward ran
    in the scheduler's thread and that results come out 0.8 into the next step; the profile carries it."""
    from dpboard.sim.calibrate import table_from_logs
    from dpboard.steplog import format as fmt
    from dpboard.steplog.reader import read_step_log, step_log_paths
    from dpboard.steplog.writer import StepLog

    rng = np.random.default_rng(5)
    log = StepLog(tmp_path, engine="sglang", rank=0, header={"settings": HEADER}, max_bytes=1 << 24, at_exit=False)
    span = 10_000_000
    for i in range(400):
        prefill = i % 5 == 0
        tokens, reqs = (int(rng.integers(50, 900)), 0) if prefill else (0, int(rng.integers(1, 12)))
        log.record(i * span, span + 8_000_000, i, 0, reqs * 300, tokens, int(prefill), reqs, reqs, max(1, reqs),
                   fmt.EXTEND if prefill else fmt.DECODE, fmt.OVERLAPPED, launch_ns=7_500_000)
    log.close()
    table, settings = table_from_logs([read_step_log(p) for p in step_log_paths(tmp_path)])
    assert np.isnan(table.result_in_next[-2:]).all()
    assert table.result_in_next[:-2] == pytest.approx(0.8)
    fit = fit_profile(table, settings)
    assert fit.sync_forward is True and fit.result_share == pytest.approx(0.8)
    assert "80% into the next step" in fit.report()
    path = tmp_path / "cpu.profile"
    path.write_text(fit.profile_text("cpu", "a CPU-like log"))
    assert load_profile_file(path).rank.result_share == pytest.approx(0.8)
    # steps that did not overlap say nothing of it
    plain = dataclasses.replace(table, result_in_next=np.full(len(table.mode), np.nan))
    assert fit_profile(plain, settings).result_share is None

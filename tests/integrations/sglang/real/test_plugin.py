"""The plugin as SGLang loads it: SGLang's plugin loader and HookRegistry, the two factories at their
real call sites, the round trip of SGLang's LoadSnapshot, and the requests a scheduler takes in."""

from __future__ import annotations

import ast
import sys
import time

import msgspec
import pytest

import dpboard
from dpboard.board import list_boards, segment_path
from dpboard.integrations.sglang import transport
from dpboard.integrations.sglang.transport import BoardLoadReader, BoardLoadWriter, board_name_for
from dpboard.snapshot import SlotStatus
from tests.integrations.sglang.real.conftest import dpc, drop_boards, ls
from tests.support import sglang as sgl
from tests.support.names import new_board_name
from tests.support.other_user import as_nobody
from tests.support.raw import plant_board


def encoded(snap) -> list:
    """What SGLang shows of a snapshot, ``to_dict(include={"all"})``, with each value's type (0 and
    0.0 compare equal, but a client sees the difference)."""
    return typed(snap.to_dict(include={"all"}))


def typed(value):
    if isinstance(value, dict):
        return [(k, typed(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


# -- the loader and the hooks ------------------------------------------------------------------------


def test_sglangs_loader_finds_the_entry_point(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "dpboard")
    found = plugins_by_group()
    assert set(found) == {"dpboard"}
    func, dist = found["dpboard"]
    assert dist == "dpboard"
    assert func is sys.modules["dpboard.integrations.sglang"].register
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    assert plugins_by_group() == {}  # SGLang's whitelist turns it off


def plugins_by_group():
    import sglang.srt.plugins as plugins

    return plugins.load_plugins_by_group("sglang.srt.plugins")


def test_hooks_are_applied_to_sglangs_targets(loaded_plugins):
    factories = {f"sglang.srt.managers.load_snapshot.create_load_snapshot_{kind}" for kind in ("writer", "reader")}
    intake = {f"sglang.srt.managers.scheduler.Scheduler.{m}" for m in ("handle_generate_request",
                                                                       "handle_embedding_request")}
    controller = {f"sglang.srt.managers.data_parallel_controller.DataParallelController.{m}" for m in (
        "__init__", "total_tokens_scheduler", "total_requests_scheduler", "refresh_load_budget",
        "update_active_ranks", "_refresh_active_workers")}
    assert factories | intake | controller | {"sglang.srt.server_args.PortArgs.init_new"} <= loaded_plugins
    # The REPLACE reached the name the DP controller imported with `from ... import` (SGLang
    # rebinds such names when it patches).
    assert dpc.create_load_snapshot_reader is ls.create_load_snapshot_reader
    assert ls.create_load_snapshot_writer.__wrapped__.__module__ == "sglang.srt.managers.load_snapshot"


def test_the_hooked_methods_exist_in_sglangs_source():
    """The scheduler is a stand-in here: check that the real one defines what the hooks target,
    and that its request dispatcher sends the tokenized requests there."""
    source = (sgl.sglang_root() / "srt" / "managers" / "scheduler.py").read_text()
    tree = ast.parse(source)
    scheduler = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {n.name: n for n in scheduler.body if isinstance(n, ast.FunctionDef)}
    for name in ("handle_generate_request", "handle_embedding_request"):
        args = methods[name].args
        assert [a.arg for a in args.args] == ["self", "recv_req"] and [a.arg for a in args.kwonlyargs] == [
            "mm_input_error"]
    assert "(TokenizedGenerateReqInput, self.handle_generate_request)" in source
    assert "(TokenizedEmbeddingReqInput, self.handle_embedding_request)" in source
    assert "self.load_snapshot_writer = create_load_snapshot_writer(" in source
    port_args = next(n for n in ast.parse((sgl.sglang_root() / "srt" / "server_args.py").read_text()).body
                     if isinstance(n, ast.ClassDef) and n.name == "PortArgs")
    init_new = next(n for n in port_args.body if isinstance(n, ast.FunctionDef) and n.name == "init_new")
    assert [d.id for d in init_new.decorator_list] == ["staticmethod"]


# -- the factories -------------------------------------------------------------------------------------


def test_the_factories_return_board_objects_with_sglangs_interface(instance):
    writer = ls.create_load_snapshot_writer(instance.port_args, 3, 1, publish_interval=15)
    assert isinstance(writer, BoardLoadWriter)
    assert (writer.dp_size, writer.dp_rank, writer.publish_interval, writer.publish_counter) == (3, 1, 15, 0)
    assert writer.path == str(segment_path(instance.board))
    for caller in ("DataParallelController", "TokenizerManager", "MultiTokenizerRouter"):
        reader = ls.create_load_snapshot_reader(instance.port_args, caller=caller)
        assert isinstance(reader, BoardLoadReader) and reader.dp_size == 3
        # As SGLang's writer does at construction: the rank reads as an all-zero snapshot.
        assert encoded(reader.read(1)) == encoded(ls.LoadSnapshot(dp_rank=1))
        assert reader.read(0) is None and reader.read(3) is None and reader.read(-1) is None
        assert [s.dp_rank for s in reader.read_all()] == [1]
    with pytest.raises(ValueError, match="invalid dp_rank=3 for dp_size=3"):
        ls.create_load_snapshot_writer(instance.port_args, 3, 3)
    with pytest.raises(ValueError, match="snapshot dp_rank=2 does not match writer dp_rank=1"):
        writer.write(ls.LoadSnapshot(dp_rank=2))
    writer.close()


def test_the_board_is_named_after_the_instance(loaded_plugins, monkeypatch):
    monkeypatch.delenv("DPBOARD_BOARD", raising=False)
    sgl.set_context(dp_size=2, role="tokenizer")
    instance_id = "a1b2" + new_board_name().replace("-", "")[-8:]
    try:
        # SGLang's main process: the board is made when the port args are (before any scheduler).
        port_args = sys.modules["sglang.srt.server_args"].PortArgs.init_new(server_args=None)
        name = board_name_for(port_args.instance_id)
        assert name == f"sglang-{port_args.instance_id}"
        listing = {entry.name: entry for entry in list_boards()}
        assert name in listing and listing[name].header.n_slots == 2
        assert listing[name].header.creator_pid == __import__("os").getpid()
        # Another process of the instance (a scheduler) finds it under the same name.
        sgl.set_context(dp_size=2, role="scheduler")
        writer = ls.create_load_snapshot_writer(port_args, 2, 0)
        assert writer.board_name == name
        # The DP controller makes port args too; they leave no board behind.
        sgl.set_context(dp_size=2, role="dp_controller")
        other = sys.modules["sglang.srt.server_args"].PortArgs.init_new(server_args=None)
        assert board_name_for(other.instance_id) not in {entry.name for entry in list_boards()}
        # An instance id that is not a plain name still gives a name a user can type.
        odd = board_name_for(f"unit/test {instance_id}")
        assert odd.startswith("sglang-unit_test_") and dpboard.board.validate_name(odd)
    finally:
        drop_boards()
        sgl.reset_context()


# -- the round trip ------------------------------------------------------------------------------------


def test_every_field_and_section_round_trips(instance):
    writers = [ls.create_load_snapshot_writer(instance.port_args, 3, r) for r in range(3)]
    reader = ls.create_load_snapshot_reader(instance.port_args, caller="TokenizerManager")
    for k in (1, 2):
        written = sgl.varied_snapshots(3, k)
        for w, snap in zip(writers, written, strict=True):
            w.write(snap)
        back = reader.read_all()
        assert [s.dp_rank for s in back] == [0, 1, 2]
        for got, want in zip(back, written, strict=True):
            assert got.to_dict(include={"all"}) == want.to_dict(include={"all"})
            assert encoded(got) == encoded(want)
            assert encoded(reader.read(want.dp_rank)) == encoded(want)


def test_a_board_without_detail_reads_as_its_dispatch_fields(instance):
    """A slot written by dpboard's own publisher: the core keys from the dispatch fields."""
    from dpboard import Board, LoadSnapshot

    reader = ls.create_load_snapshot_reader(instance.port_args, caller="TokenizerManager")
    board = Board.attach(instance.board)
    try:
        board.writer(2).publish(LoadSnapshot(dp_rank=2, num_running_reqs=4, num_waiting_reqs=6, num_used_tokens=300,
                                             num_total_tokens=700, num_active_tokens=650, max_total_num_tokens=1200))
        got = reader.read(2)
        d = got.to_dict()
        assert (d["num_running_reqs"], d["num_waiting_reqs"], d["num_used_tokens"], d["num_total_tokens"],
                d["num_active_tokens"], d["max_total_num_tokens"]) == (4, 6, 300, 700, 650, 1200)
        assert d["token_usage"] == 300 / 1200 and abs(d["timestamp"] - time.time()) < 60
        assert d["decode_moments"] is None and d["gen_throughput"] == 0.0 and d["max_running_requests"] == 0
        assert set(d) == set(ls._CORE_KEYS)  # no section
    finally:
        board.close()


# -- the requests a scheduler takes in ------------------------------------------------------------------


class Inquirer:
    """The scheduler's load inquirer: hands out the snapshot the test sets."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def get_loads(self):
        return self.snapshot


def test_the_intake_hook_counts_what_the_scheduler_takes_in(instance):
    io = sys.modules["sglang.srt.managers.io_struct"]
    Scheduler = sys.modules["sglang.srt.managers.scheduler"].Scheduler
    writer = ls.create_load_snapshot_writer(instance.port_args, 3, 2, publish_interval=3)
    scheduler = Scheduler(load_snapshot_writer=writer, load_inquirer=Inquirer(sgl.full_snapshot(2)))
    follower = Scheduler(load_snapshot_writer=None)  # an attention-TP rank of the same DP group

    def req(rid):
        return io.TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3])

    requests = [req(f"r{i}") for i in range(4)] + [req("HEALTH_CHECK_1")]
    # SGLang's own batch handler, calling the hooked handle_generate_request once per request
    Scheduler.handle_batch_generate_request(scheduler, requests)
    scheduler.handle_embedding_request(io.TokenizedEmbeddingReqInput(rid="e1", input_ids=[4]))
    Scheduler.handle_batch_generate_request(follower, requests)
    assert len(scheduler.taken) == 6 and len(follower.taken) == 5
    assert writer.num_received_reqs == 5  # the health check is not counted; the follower counts nothing
    # SGLang's own publish_load_snapshot: decode batches publish every publish_interval-th call
    reader = ls.create_load_snapshot_reader(instance.port_args, caller="DataParallelController")
    from dpboard import Board

    board = Board.attach(instance.board)
    try:
        assert scheduler.publish_load_snapshot() is None and scheduler.publish_load_snapshot() is None
        assert board.reader().read(2).num_received_reqs == 0  # still the zero snapshot
        published = scheduler.publish_load_snapshot()
        assert encoded(published) == encoded(sgl.full_snapshot(2))
        assert board.reader().read(2).num_received_reqs == 5
        assert encoded(reader.read(2)) == encoded(published)
        assert scheduler.publish_load_snapshot(force=True) is not None  # prefill batches publish at once
    finally:
        board.close()


def test_staleness_reaches_sglang_as_an_unpublished_rank(instance, monkeypatch):
    """A rank that stops publishing is handed to SGLang's callers as SGLang hands a rank that never
    published: read() gives None and read_all() leaves it out."""
    monkeypatch.setenv("DPBOARD_STALE_AFTER", "0.5")
    writers = [ls.create_load_snapshot_writer(instance.port_args, 3, r) for r in range(3)]
    reader = ls.create_load_snapshot_reader(instance.port_args, caller="DataParallelController")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # ranks 0 and 2 keep publishing, rank 1 published once
        for r in (0, 2):
            writers[r].write(sgl.full_snapshot(r))
        time.sleep(0.02)
    for r in (0, 2):
        writers[r].write(sgl.full_snapshot(r))
    assert reader.read(1) is None and [s.dp_rank for s in reader.read_all()] == [0, 2]
    from dpboard import Board

    board = Board.attach(instance.board)
    try:
        assert board.reader(stale_after=0.5).status(1) == SlotStatus.STALE
    finally:
        board.close()
    writers[1].write(sgl.full_snapshot(1))  # it comes back with its next publish
    assert encoded(reader.read(1)) == encoded(sgl.full_snapshot(1))


def test_sglangs_own_reader_hands_an_unpublished_rank_the_same_way(tmp_path):
    """What 'unpublished' is in SGLang 0.5.23, from its own SHM reader: None and left out."""
    path = str(tmp_path / "loads.shm")
    own = [ls.ShmLoadSnapshotWriter(path, 3, r) for r in (0, 2)]
    reader = ls.ShmLoadSnapshotReader(path, 3)
    assert reader.read(1) is None and [s.dp_rank for s in reader.read_all()] == [0, 2]
    for w in own:
        w.close()
    reader.close()


def test_struct_changes_in_sglang_would_fail_here():
    """The slot carries exactly the fields SGLang's structs have (a new SGLang field must fail a test)."""
    from dpboard.snapshot import DETAIL_SCALARS, DETAIL_SECTIONS, LoadSnapshot

    sglang_fields = set(ls.LoadSnapshot.__struct_fields__)
    sections = {"memory": ls.MemoryMetrics, "speculative": ls.SpeculativeMetrics, "lora": ls.LoRAMetrics,
                "disaggregation": ls.DisaggregationMetrics, "queues": ls.QueueMetrics}
    ours = set(DETAIL_SCALARS) | set(LoadSnapshot._fields[:7]) | {"decode_moments"} | set(DETAIL_SECTIONS)
    assert sglang_fields == ours
    for name, struct in sections.items():
        assert struct.__struct_fields__ == DETAIL_SECTIONS[name]._fields
    assert msgspec.structs.fields(ls.LoadSnapshot)[0].name == "timestamp"


def test_a_planted_board_entry_does_not_stop_sglangs_start(loaded_plugins, monkeypatch):
    """Another local user's /dev/shm/dpboard.<x> with a header claiming 2**32-1 slots (a sparse
    file) once made the server's start fail: the board was opened after a scan of every entry,
    which copied a word per claimed slot (`Unable to allocate 32.0 GiB`). The start reads only its
    own board's entry, and a listing shows the planted one as damaged."""
    planted = new_board_name()
    monkeypatch.delenv("DPBOARD_BOARD", raising=False)
    sgl.set_context(dp_size=2, role="tokenizer")
    try:
        as_nobody(lambda: plant_board(planted, 2**32 - 1))
        port_args = sys.modules["sglang.srt.server_args"].PortArgs.init_new(server_args=None)
        name = board_name_for(port_args.instance_id)
        sgl.set_context(dp_size=2, role="scheduler")
        writer = ls.create_load_snapshot_writer(port_args, 2, 1)
        writer.write(ls.LoadSnapshot(dp_rank=1, num_running_reqs=4))
        reader = ls.create_load_snapshot_reader(port_args, caller="DataParallelController")
        assert reader.read(1).num_running_reqs == 4 and writer.board_name == name
        listing = {entry.name: entry for entry in list_boards()}
        assert "claims 4294967295 slots" in listing[planted].error and listing[name].error is None
        writer.close()
    finally:
        segment_path(planted).unlink(missing_ok=True)
        drop_boards()
        sgl.reset_context()


@pytest.mark.parametrize("count", [100, -3, 9])
def test_a_malformed_moments_count_reads_alike_in_the_plugin_and_in_serve(instance, count):
    """A local detail declaring decode_moments_count=100 was read as 30 moments by the plugin (its
    slice ran into the next fields) and 8 by serve; -3 as 0 and 5. One rule now: a count outside
    0..8 is a malformed detail whose moments are unknown (None), for both readers."""
    import json

    import numpy as np

    from dpboard import Board, LoadSnapshot
    from dpboard.snapshot import DETAIL_DTYPE, LoadDetail, pack_detail
    from tests.support.serving import get, start_server

    ls.create_load_snapshot_writer(instance.port_args, 3, 0).close()  # the instance's board, as SGLang makes it
    reader = ls.create_load_snapshot_reader(instance.port_args, caller="TokenizerManager")
    writer = Board.attach(instance.board).writer(1)  # a malformed writer of rank 1's slot
    detail = pack_detail(LoadDetail(decode_moments=(1.0, 2.0, 3.0)), np.zeros(1, DETAIL_DTYPE))
    detail["decode_moments_count"] = count
    writer.publish(LoadSnapshot(1, num_running_reqs=4), detail)
    assert reader.read(1).decode_moments is None
    assert reader.read(1).num_running_reqs == 4  # the rest of the snapshot is read
    proc, url = start_server(instance.board, "--stale-after", "60")
    try:
        doc = json.loads(get(f"{url}/v1/loads?dp_rank=1")[2])
    finally:
        proc.terminate()
        proc.wait(10)
    assert doc["loads"][0]["decode_moments"] is None
    writer.close()


def test_a_rank_under_dp_attention_publishes_its_lockstep_section(instance):
    from dpboard.snapshot import LockstepDetail

    sgl.set_context(dp_size=3, attn_dp_enabled=True, chunked_prefill_size=2730)
    writer = ls.create_load_snapshot_writer(instance.port_args, 3, 1)
    writer.write(sgl.full_snapshot(1, 1))
    board = transport._boards[instance.board]
    _, _, detail = board.reader().read_detail(1)
    assert detail.lockstep == LockstepDetail(group_size=3, chunk_tokens=2730)
    # SGLang reads its snapshot back unchanged: the section is dpboard's own
    reader = ls.create_load_snapshot_reader(instance.port_args, caller="TokenizerManager")
    assert reader.read(1).to_dict(include={"all"}) == sgl.full_snapshot(1, 1).to_dict(include={"all"})
    # without DP attention: no section
    sgl.set_context(dp_size=3)
    plain = ls.create_load_snapshot_writer(instance.port_args, 3, 2)
    plain.write(sgl.full_snapshot(2, 1))
    assert board.reader().read_detail(2)[2].lockstep is None

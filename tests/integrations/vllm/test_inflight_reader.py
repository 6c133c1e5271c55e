"""The API server's reader of its engines (``GlobalInflightReader``): a slot whose writer's lock is
gone reads STALE, and only from a look at the locks that came after the slot's last publish. A real
board, sent record and writers in /dev/shm; no vLLM needed. A TORN read (a writer caught mid-write) changes no count."""

from __future__ import annotations

import struct
import time

from dpboard import Board, LoadSnapshot
from dpboard.board.sent import SentRecord
from dpboard.integrations.vllm.dispatch import GlobalInflightReader
from dpboard.snapshot import SEQ_OFFSET, SlotStatus, slot_offset
from tests.support.raw import raw_segment


def test_an_engine_that_starts_after_a_look_reads_live_and_one_whose_writer_left_reads_stale(board_name):
    """Node 1's API server (engines 2 and 3 of a 4-slot board): its first read looks at the locks
    before engine 3 has a writer; engine 3 starts and publishes before the next look, and reads LIVE.
    Engine 2's writer closes: the next look finds its lock gone, and it reads STALE."""
    with Board.create(board_name, n_slots=4) as board:
        sent = SentRecord.open(board_name, 1, 4, generation=board.generation)
        locks = board.slot_locks(interval=0.05)
        engine2 = board.writer(2)
        engine3 = None
        try:
            engine2.publish(LoadSnapshot(dp_rank=2, max_total_num_tokens=1000))
            reader = GlobalInflightReader(board.reader(stale_after=60.0), sent, [2, 3], sent.row(0), locks)
            assert reader.read_array()["status"].tolist() == [SlotStatus.LIVE, SlotStatus.EMPTY]  # a look
            engine3 = board.writer(3)
            engine3.publish(LoadSnapshot(dp_rank=3, max_total_num_tokens=1000))
            assert reader.read_array()["status"].tolist() == [SlotStatus.LIVE, SlotStatus.LIVE]  # no look yet
            engine2.close()  # its lock goes with it; its last stamp is recent
            time.sleep(0.06)
            assert reader.read_array()["status"].tolist() == [SlotStatus.STALE, SlotStatus.LIVE]
        finally:
            for writer in (engine2, engine3):
                if writer is not None:
                    writer.close()
            locks.close()
            sent.close()
            board.unlink()
            sent.unlink()


def test_a_torn_read_forgets_no_request_in_flight(board_name):
    """Engine 0 received 5 of the 7 requests sent to it: 2 in flight. A read that finds its writer
    mid-write (the sequence odd: the slot reads TORN, as zeros) is no restart of its counter: the
    next whole read still counts the 2 in flight, where taking the zeros for a counter begun again
    had re-based them away."""
    with Board.create(board_name, n_slots=2) as board:
        sent = SentRecord.open(board_name, 1, 2, generation=board.generation)
        writers = [board.writer(r) for r in range(2)]
        try:
            row = sent.row(0)
            for _ in range(7):
                row.add(0, 10)
            writers[0].publish(LoadSnapshot(dp_rank=0, num_received_reqs=5, max_total_num_tokens=1000))
            writers[1].publish(LoadSnapshot(dp_rank=1, max_total_num_tokens=1000))
            reader = GlobalInflightReader(board.reader(stale_after=60.0, max_retries=4), sent, [0, 1], row)
            assert reader.read_array()["num_waiting_reqs"].tolist() == [2, 0]
            with raw_segment(board.name) as raw:
                seq = struct.unpack_from("<Q", raw, slot_offset(0) + SEQ_OFFSET)[0]
                struct.pack_into("<Q", raw, slot_offset(0) + SEQ_OFFSET, seq + 1)  # mid-write
            assert reader.read_array()["status"].tolist() == [SlotStatus.TORN, SlotStatus.LIVE]
            with raw_segment(board.name) as raw:
                struct.pack_into("<Q", raw, slot_offset(0) + SEQ_OFFSET, seq + 2)  # the write ends
            records = reader.read_array()
            assert records["status"].tolist() == [SlotStatus.LIVE, SlotStatus.LIVE]
            assert records["num_waiting_reqs"].tolist() == [2, 0] and reader.in_flight.tolist() == [2, 0]
        finally:
            for writer in writers:
                writer.close()
            sent.close()
            board.unlink()
            sent.unlink()

"""The seqlocked rows of the side records (SeqRow, read_rows: dpb_seqlock.h), on a real shared
mapping: a reader copies a row only from one whole write, a row left odd reads as torn, and a
writer in another process never lets a reader see half of an add."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dpboard.board._seqlock import SeqRow, read_rows

ROW = 64


def test_a_whole_write_is_copied_and_an_open_one_is_torn():
    mapping = mmap.mmap(-1, 2 * ROW)
    row = SeqRow(mapping, ROW, ROW)
    row.add(2, 1, 10)
    out, whole = np.zeros((2, ROW // 8), np.int64), np.zeros(2, bool)
    assert read_rows(mapping, 0, ROW, 2, out, whole, 4) == 0
    assert whole.tolist() == [True, True] and out[1, :4].tolist() == [2, 0, 1, 10]
    row.begin()  # a writer stopped mid-write: the row stays odd
    np.frombuffer(mapping, np.int64)[ROW // 8 + 2] = 99
    assert read_rows(mapping, 0, ROW, 2, out, whole, 4) == 1
    assert whole.tolist() == [True, False]
    row.add(2, 1, 10)  # inside the open write: one write still
    row.end()
    assert read_rows(mapping, 0, ROW, 2, out, whole, 4) == 0
    assert out[1, :4].tolist() == [4, 0, 100, 20]
    row.release()
    mapping.close()  # released: the mapping is no longer exported


def test_a_row_left_odd_by_a_dead_writer_is_made_whole_by_the_next():
    mapping = mmap.mmap(-1, ROW)
    SeqRow(mapping, 0, ROW).begin()  # its writer gone, mid-write
    later = SeqRow(mapping, 0, ROW)
    assert later.sequence == 1
    later.begin()
    later.end()
    assert later.sequence == 2
    assert read_rows(mapping, 0, ROW, 1, bytearray(ROW), None, 1) == 0


def test_bad_rows_are_refused_with_one_line():
    mapping = mmap.mmap(-1, 2 * ROW)
    with pytest.raises(ValueError, match="do not fit the 128-byte mapping"):
        SeqRow(mapping, ROW + 8, ROW)
    with pytest.raises(ValueError, match="multiples of 8"):
        SeqRow(mapping, 4, ROW)
    with pytest.raises(IndexError, match="not data words"):
        SeqRow(mapping, 0, ROW).add(0, 1, 1)  # the sequence word is the seqlock's
    with pytest.raises(ValueError, match="at least 128 bytes"):
        read_rows(mapping, 0, ROW, 2, bytearray(ROW), None, 4)
    with pytest.raises(ValueError, match="max_retries"):
        read_rows(mapping, 0, ROW, 2, bytearray(2 * ROW), None, 0)
    row = SeqRow(mapping, 0, ROW)
    row.release()
    with pytest.raises(ValueError, match="released"):
        row.add(1, 1, 1)
    with pytest.raises(RuntimeError, match="without begin"):
        SeqRow(mapping, 0, ROW).end()


_WRITER = textwrap.dedent("""
    import mmap, sys
    from dpboard.board._seqlock import SeqRow
    fd = int(sys.argv[1])
    mapping = mmap.mmap(fd, 64)
    row = SeqRow(mapping, 0, 64)
    print("ready", flush=True)
    for _ in range(200_000):
        row.add(2, 1, 7)
""")


def test_a_reader_never_sees_half_of_another_process_add(tmp_path):
    path = tmp_path / "row"
    path.write_bytes(bytes(ROW))
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), ROW)
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(f.fileno())], pass_fds=(f.fileno(),),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            out, whole = np.zeros((1, ROW // 8), np.int64), np.zeros(1, bool)
            copies = 0
            while proc.poll() is None and copies < 100_000:
                if read_rows(mapping, 0, ROW, 1, out, whole, 64) == 0:
                    assert out[0, 3] == 7 * out[0, 2]  # the two words of each add, always together
                    copies += 1
            assert proc.wait(timeout=120) == 0
            read_rows(mapping, 0, ROW, 1, out, whole, 64)
            assert out[0, 2:4].tolist() == [200_000, 1_400_000]
        finally:
            proc.kill()
            proc.wait()
            mapping.close()

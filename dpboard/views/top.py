"""``dpboard top NAME``: a live terminal view of a board.

One row per rank (requests, tokens, a KV-usage bar, snapshot age coloured by liveness, writer pid,
publish rate and a sparkline of the rank's recent total tokens) under a header with the imbalance
(max / mean of total tokens over live ranks), totals and rates. Where vLLM's API servers keep a
sent record beside the board, each engine's requests in flight (sent, not yet received) too. Where
a dispatcher of the board holds arrivals for waves (``inflight_wave``), a header line says what its
hold did, read from the board's dispatch record (``wave_line``). ``--once`` prints one frame,
``--json`` one frame as JSON; without a terminal the live view prints plain-text frames instead.

Imports the board and rich only: no Numba, no CuPy, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dpboard.board import DEFAULT_STALE_AFTER, MAX_SLOTS
from dpboard.board.dispatch_record import WAVE_REASONS, DispatchRowSample, read_wave_rows
from dpboard.board.stale import stale_after
from dpboard.errors import AccessDeniedError, InvalidInputError, UnavailableError
from dpboard.options import count, seconds
from dpboard.snapshot import SlotStatus
from dpboard.views.doctor import DoctorWatch, header_line
from dpboard.views.rows import fmt_age, status_of
from dpboard.views.watch import SORT_KEYS, BoardWatch, Frame

STATUS_STYLE = {SlotStatus.LIVE.label: "green", SlotStatus.STALE.label: "yellow", SlotStatus.TORN.label: "bold red",
                SlotStatus.EMPTY.label: "dim"}
STATUS_NOTE = {SlotStatus.EMPTY: "never written", SlotStatus.TORN: "writer stopped mid-write"}
STATUS_NOTE_SHORT = {SlotStatus.EMPTY: "unwritten", SlotStatus.TORN: "mid-write"}  # for a narrow column
SPARK_CHARS = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 12
PLAIN_WIDTH = 132  # a plain-text frame fits its widest row in this many columns
HISTORY_WIDTH = 24  # samples shown in the sparkline column
HEADER_LINES = 6  # header, table heading and footer: what remains of the screen is for rows
DOCTOR_WINDOW = 10.0  # seconds of samples behind the header's doctor line
DEFAULT_PLAIN_ROWS = 64  # rows of a plain-text frame (no terminal to measure): --rows 0 shows them all


# -- formatting (fixed widths, so that rows do not jump between refreshes) ----------------------


def fmt_count(n: int | None) -> str:
    """At most 6 characters: exact below 100000, then k / M / G with three significant digits."""
    if n is None:
        return "-"
    if abs(n) < 100_000:
        return str(n)
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        v = n / scale
        if abs(v) < 999.5:
            return f"{v:.3g}{unit}" if abs(v) >= 100 else f"{v:.1f}{unit}"
    return f"{n / 1e15:.0f}P"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    if rate < 10:
        return f"{rate:.1f}"
    return fmt_count(int(round(rate)))


def usage_bar(fraction: float, width: int = BAR_WIDTH) -> Text:
    """A bar of eighth blocks and the percentage, coloured by how full the KV cache is."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    bar = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    style = "green" if fraction < 0.7 else "yellow" if fraction < 0.9 else "red"
    text = Text(bar.ljust(width), style=style)
    text.append(f" {fraction * 100:3.0f}%")
    return text


def sparkline(values: list[int], top: int, width: int) -> str:
    """The last ``width`` values as block characters scaled to ``top``, right-aligned."""
    values = values[-width:]
    if top <= 0:
        return (SPARK_CHARS[0] * len(values)).rjust(width)
    chars = [SPARK_CHARS[min(7, int(v * 7 / top + 0.5))] for v in values]
    return "".join(chars).rjust(width)


def _imbalance_text(value: float | None) -> Text:
    if value is None:
        return Text("-", style="dim")
    style = "green" if value < 1.2 else "yellow" if value < 1.5 else "bold red"
    return Text(f"{value:.2f}x", style=style)


# -- the frame ----------------------------------------------------------------------------------


def fmt_like(n: int, like: int) -> str:
    """``n`` in the unit ``fmt_count`` gives ``like``, so that "used/capacity" reads in one unit."""
    if abs(like) < 100_000:
        return str(n)
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        if fmt_count(like).endswith(unit):
            v = n / scale
            return f"{v:.3g}{unit}" if abs(v) >= 100 else f"{v:.1f}{unit}"
    return fmt_count(n)


def _flow(lines: list[list[Text]], width: int | None) -> Text:
    """Each line's parts joined by two spaces, broken between parts where ``width`` runs out."""
    text = Text()
    for parts in lines:
        used = 0
        for i, part in enumerate(parts):
            if i and width is not None and used + 2 + len(part) > width:
                text.append("\n")
                used = 0
            elif i:
                text.append("  ")
                used += 2
            text.append_text(part)
            used += len(part)
        text.append("\n")
    text.rstrip()
    return text


def wave_line(row: DispatchRowSample, *, named: bool = False) -> list[Text]:
    """What an inflight_wave dispatcher's hold did (its row of the dispatch record): requests held
    (and held now), waves, releases by reason, the longest hold against its budget and the mean,
    the most bytes held at once. ``named``: say which row (more than one holds)."""
    w = row.wave
    assert w is not None
    released = sum(w.released)
    mean = w.hold_sum_s / released if released else 0.0
    reasons = ", ".join(f"{reason} {fmt_count(n)}" for reason, n in zip(WAVE_REASONS, w.released, strict=True) if n)
    return [Text(f"wave (row {row.row})" if named else "wave", style="bold"),
            Text(f"held {fmt_count(w.held)} ({fmt_count(w.holding)} now)"), Text(f"waves {fmt_count(w.waves)}"),
            Text(f"released {reasons or 'none yet'}"),
            Text(f"hold max {w.hold_max_s:.2f} s of {w.max_hold_s:g} s, mean {mean:.2f} s"),
            Text(f"held max {w.held_bytes_max / 2**20:.1f} MiB")]


def render_header(frame: Frame, width: int | None = None, waves: list[DispatchRowSample] | None = None) -> Text:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(frame.wall_time_ns / 1e9))
    first = [Text("dpboard top", style="bold"), Text(f"board {frame.board}", style="bold cyan"),
             Text(f"{frame.n_slots} slot{'s' if frame.n_slots != 1 else ''}"), Text(f"node {frame.node_id}"),
             Text(f"creator pid {frame.creator_pid}"), Text(when)]
    second = [Text("ranks")]
    for label in (s.label for s in (SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.TORN, SlotStatus.EMPTY)):
        n = frame.counts.get(label, 0)
        second.append(Text(f"{n} {label}", style=STATUS_STYLE[label] if n else "dim"))
    imb = Text("imbalance ")
    imb.append_text(_imbalance_text(frame.imbalance))
    second.append(imb)
    second.append(Text("(max/mean total tokens over live ranks)", style="dim"))
    t = frame.totals
    cap = t.get("max_total_num_tokens", 0)
    used = t.get("num_used_tokens", 0)
    usage = f" ({used / cap:.0%})" if cap else ""
    third = [Text(x) for x in (
        f"running {fmt_count(t.get('num_running_reqs'))}", f"waiting {fmt_count(t.get('num_waiting_reqs'))}",
        f"KV used {fmt_like(used, cap)}/{fmt_count(cap)}{usage}",
        f"total tokens {fmt_count(t.get('num_total_tokens'))}", f"active {fmt_count(t.get('num_active_tokens'))}",
        f"publishes/s {fmt_rate(frame.publish_rate)}", f"requests/s {fmt_rate(frame.request_rate)}",
    )]
    if "in_flight" in t:  # vLLM's API servers' sent record: sent and not yet received, every engine
        third.append(Text(f"in flight {fmt_count(t['in_flight'])}"))
    lines = [first, second, third]
    lines.extend(wave_line(row, named=len(waves) > 1) for row in waves or [])
    if frame.doctor is not None:
        line = header_line(frame.doctor)
        faults = [f for f in frame.doctor["findings"] if f["severity"] != "info"]
        style = "green" if not faults else "bold red" if faults[0]["severity"] == "critical" else "yellow"
        # a narrow terminal wraps it between words, as the lines above between their items
        lines.extend([Text(part, style=style)] for part in
                     (textwrap.wrap(line, width, break_on_hyphens=False) if width else [line]))
    return _flow(lines, width)


# Columns: (title, width, justify). As the terminal narrows, whole columns go, in DROP_ORDER (the
# history first narrows, down to MIN_HISTORY); RANK and STATE always stay, so rows can be told apart.
# INFLIGHT (requests sent and not yet received, from the board's sent record) only where one exists.
INFLIGHT = "INFLIGHT"
COLUMNS = (
    ("RANK", 5, "right"), ("STATE", 5, "left"), ("RUN", 6, "right"), ("WAIT", 6, "right"), (INFLIGHT, 8, "right"),
    ("TOTAL TOK", 9, "right"), ("ACTIVE TOK", 10, "right"), ("KV USAGE", BAR_WIDTH + 5, "left"),
    ("AGE", 7, "right"), ("PUB/S", 6, "right"), ("PID", 7, "right"), ("HISTORY (total tokens)", HISTORY_WIDTH, "left"),
)
DROP_ORDER = ("HISTORY (total tokens)", "PID", "PUB/S", "ACTIVE TOK", INFLIGHT, "AGE", "KV USAGE", "TOTAL TOK", "WAIT", "RUN")
MIN_HISTORY = 8
COLUMN_GAP = 3  # a space of padding each side of a column and the (blank) divider between them


def fit_columns(width: int | None, history_width: int = HISTORY_WIDTH, *,
                in_flight: bool = False) -> list[tuple[str, int, str]]:
    """The columns shown in ``width`` terminal columns (None: all), with their widths; INFLIGHT only
    with ``in_flight`` (the board has a sent record)."""
    cols = [(t, history_width if t.startswith("HISTORY") else w, j) for t, w, j in COLUMNS
            if in_flight or t != INFLIGHT]
    if width is None:
        return cols

    def total() -> int:
        return sum(w for _, w, _ in cols) + COLUMN_GAP * (len(cols) - 1)

    for title in DROP_ORDER:
        if total() <= width:
            break
        if title.startswith("HISTORY"):
            spare = width - (total() - history_width)
            if spare >= MIN_HISTORY:
                cols[-1] = (title, spare, "left")
                continue
        cols = [c for c in cols if c[0] != title]
    return cols


def render_table(frame: Frame, rows: list[dict[str, Any]], history_width: int = HISTORY_WIDTH,
                 width: int | None = None) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False, padding=(0, 1))
    cols = fit_columns(width, history_width, in_flight="in_flight" in frame.totals)
    for title, w, justify in cols:
        table.add_column(title if len(title) <= w else title.split(" (")[0], width=w, min_width=w, max_width=w, justify=justify, no_wrap=True)
    shown = [title for title, _, _ in cols]
    spark_width = next((w for t, w, _ in cols if t.startswith("HISTORY")), history_width)
    top = max((max(row.get("history") or [0]) for row in rows), default=0)
    for row in rows:
        status = row["status"]
        style = STATUS_STYLE[status]
        if not status_of(row).has_snapshot:
            cells: dict[str, RenderableType] = {"AGE": Text("-", style=style)}
            # the note sits in the widest column left after STATE
            note_col = next((c for t in ("HISTORY (total tokens)", "KV USAGE", "TOTAL TOK") for c in cols
                             if c[0] == t), None)
            if note_col:
                note = STATUS_NOTE[status_of(row)]
                cells[note_col[0]] = Text(note if len(note) <= note_col[1] else STATUS_NOTE_SHORT[status_of(row)],
                                          style=style)
        else:
            cells = {
                "RUN": fmt_count(row["num_running_reqs"]),
                "WAIT": fmt_count(row["num_waiting_reqs"]),
                INFLIGHT: fmt_count(row.get("in_flight")),
                "TOTAL TOK": fmt_count(row["num_total_tokens"]),
                "ACTIVE TOK": fmt_count(row["num_active_tokens"]),
                "KV USAGE": usage_bar(row["token_usage"]),
                "AGE": Text(fmt_age(row["age_s"]), style=style),
                "PUB/S": fmt_rate(row.get("publish_rate")),
                "PID": str(row["writer_pid"]),
                "HISTORY (total tokens)": Text(sparkline(row.get("history") or [], top, spark_width), style="cyan"),
            }
        cells["RANK"] = str(row["dp_rank"])
        cells["STATE"] = Text(status, style=style)
        table.add_row(*(cells.get(title, "") for title in shown))
    return table


def render(frame: Frame, *, sort: str = "rank", max_rows: int | None = None, hint: str = "",
           width: int | None = None, waves: list[DispatchRowSample] | None = None) -> RenderableType:
    """The whole view of one frame; ``max_rows`` keeps it within a screen of the usual three header
    lines (a narrow ``width`` wraps the header and takes the extra lines from the rows). ``waves``:
    the dispatch record's rows that hold for waves (``frame_waves``), a header line each."""
    if frame.gone is not None:
        return Text(f"dpboard top: {frame.gone}\n", style="bold yellow")
    header = render_header(frame, width, waves)
    if max_rows is not None:
        max_rows -= max(header.plain.count("\n") + 1 - 3, 0)
    rows = frame.sorted_rows(sort)
    hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        hidden = len(rows) - max(max_rows, 1)
        rows = rows[: max(max_rows, 1)]
    footer = Text(style="dim")
    if hidden:
        footer.append(f"... {hidden} more rank{'s' if hidden != 1 else ''} below (sorted by {sort}; "
                      f"--sort total shows the busiest first, --rows more of them)\n")
    footer.append(hint)
    parts: list[RenderableType] = [header, render_table(frame, rows, width=width)]
    if footer.plain:
        parts.append(footer)
    return Group(*parts)


def render_text(frame: Frame, *, sort: str = "rank", width: int = PLAIN_WIDTH, color: bool = False,
                max_rows: int | None = None, waves: list[DispatchRowSample] | None = None) -> str:
    """One frame as text (no escape codes unless ``color``): for pipes, logs and tests. The cost is
    that of the rows shown: ``max_rows`` keeps a 65,536-rank board's frame to what is read."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      color_system="standard" if color else None, highlight=False, soft_wrap=False)
    console.print(render(frame, sort=sort, max_rows=max_rows, width=width, waves=waves))
    return buf.getvalue()


def frame_waves(watch: BoardWatch, frame: Frame) -> list[DispatchRowSample]:
    """The rows of the frame's board's dispatch record that hold for waves (none while it is gone)."""
    return [] if frame.gone is not None else read_wave_rows(frame.board, trust_uids=watch.trust_uids)


def frame_document(frame: Frame, waves: list[DispatchRowSample]) -> dict[str, Any]:
    """``--json``'s document: the frame's, and, where a dispatcher holds for waves, ``waves``."""
    doc = frame.as_dict()
    if waves:
        doc["waves"] = [{"row": r.row, "pid": r.pid, "method": r.method, **r.wave.as_dict()} for r in waves]
    return doc


# -- the command ---------------------------------------------------------------------------------


def add_top_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="board name (without the dpboard. prefix)")
    p.add_argument("--interval", type=seconds(), default=0.5, help="seconds between refreshes (default 0.5)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print one frame as JSON and exit")
    p.add_argument("--sort", choices=sorted(SORT_KEYS), default="rank",
                   help="row order (default rank; load keys sort busiest first)")
    p.add_argument("--stale-after", type=stale_after, default=DEFAULT_STALE_AFTER,
                   help="seconds without a publish before a rank is stale (default 1.0)")
    p.add_argument("--iterations", "-n", type=count(0), default=0,
                   help="stop after this many refreshes (default 0: until Ctrl-C)")
    p.add_argument("--rows", type=count(0, MAX_SLOTS), default=None,
                   help=f"rows of a frame printed as text (--once, or no terminal): default what fits the "
                        f"terminal, else {DEFAULT_PLAIN_ROWS}; 0 shows every rank")
    p.add_argument("--wait", action="store_true", help="wait for the board to be created instead of failing")
    p.add_argument("--wait-timeout", type=seconds(), default=60.0, metavar="SECONDS",
                   help="with --wait and --once or --json: how long to wait before giving up (default 60)")
    p.add_argument("--trust-uid", type=count(0, 2**32 - 2), action="append", default=[], metavar="UID",
                   help="also show a board this user created (e.g. 0 for root); repeatable")


def _check_args(args: argparse.Namespace) -> None:
    if not args.interval > 0:
        raise InvalidInputError(f"--interval must be > 0 seconds, got {args.interval}")
    if args.iterations < 0:
        raise InvalidInputError(f"--iterations must be >= 0 (0: run until Ctrl-C), got {args.iterations}")


def text_rows(rows: int | None, stream: Any) -> int | None:
    """How many rows a text frame shows: ``--rows`` (0: all), else what fits a terminal, else 64."""
    if rows is not None:
        return rows or None
    if stream.isatty():
        return max(shutil.get_terminal_size().lines - HEADER_LINES - 1, 1)
    return DEFAULT_PLAIN_ROWS


def wait_for_board(watch: BoardWatch, timeout: float, poll: float = 0.05) -> None:
    """Until the watched board exists (``--wait`` with one frame to print), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    said = False
    while not watch.attached:
        watch.sample()  # tries to attach
        if watch.attached:
            return
        if isinstance(watch.error, AccessDeniedError):
            raise watch.error  # created meanwhile by another user: waiting longer changes nothing
        if time.monotonic() >= deadline:
            raise UnavailableError(f"board {watch.name!r} was not created within {timeout:g} s "
                                   f"(--wait-timeout SECONDS waits longer)")
        if not said:
            print(f"dpboard top: {watch.gone}", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll)


def one_frame(watch: BoardWatch, interval: float, doctor: DoctorWatch | None = None) -> Frame:
    """A frame with rates: two samples, a short while apart (the doctor's window is that while)."""
    watch.sample()
    if doctor is not None and doctor.covers(watch.board):
        doctor.observe_watch(watch)
    time.sleep(min(interval, 0.2))
    return _with_doctor(watch.sample(), watch, doctor)


def _with_doctor(frame: Frame, watch: BoardWatch, doctor: DoctorWatch | None) -> Frame:
    if doctor is not None and frame.gone is None and doctor.covers(watch.board):
        doctor.observe_watch(watch)
        frame.doctor = doctor.document()
    return frame


def run_top(args: argparse.Namespace) -> int:
    _check_args(args)
    watch = BoardWatch(args.name, stale_after=args.stale_after, wait=args.wait, trust_uids=args.trust_uid)
    rows = getattr(args, "rows", None)
    doctor = DoctorWatch(window=DOCTOR_WINDOW, every=0.0 if (args.json or args.once) else min(args.interval, 1.0),
                         stale_after=args.stale_after, trust_uids=tuple(args.trust_uid))
    try:
        if args.wait and (args.json or args.once):
            wait_for_board(watch, args.wait_timeout)
        if args.json:
            frame = one_frame(watch, args.interval, doctor)
            print(json.dumps(frame_document(frame, frame_waves(watch, frame)), indent=2))
            return 0 if frame.gone is None else 1
        if args.once:
            frame = one_frame(watch, args.interval, doctor)
            tty = sys.stdout.isatty()
            sys.stdout.write(render_text(frame, sort=args.sort, color=tty, max_rows=text_rows(rows, sys.stdout),
                                         width=shutil.get_terminal_size().columns if tty else PLAIN_WIDTH,
                                         waves=frame_waves(watch, frame)))
            return 0 if frame.gone is None else 1
        console = Console()
        if console.is_terminal:
            live_view(watch, console, interval=args.interval, sort=args.sort, iterations=args.iterations,
                      doctor=doctor)
        else:
            plain_frames(watch, interval=args.interval, sort=args.sort, iterations=args.iterations,
                         max_rows=text_rows(rows, sys.stdout), doctor=doctor)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        watch.close()


def live_view(watch: BoardWatch, console: Console, *, interval: float, sort: str = "rank",
              iterations: int = 0, should_stop: Any = None, hint: str = "Ctrl-C to quit",
              doctor: DoctorWatch | None = None) -> None:
    """Redraw the frame in place every ``interval`` seconds (rich.Live on the alternate screen)."""
    hint = f"refresh {interval:g}s  sort {sort}  stale after {watch.stale_after:g}s  {hint}"
    with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        for frame in paced_frames(watch, interval=interval, iterations=iterations, should_stop=should_stop,
                                  doctor=doctor):
            rows_fit = max(console.size.height - HEADER_LINES - 1, 1)
            live.update(render(frame, sort=sort, max_rows=rows_fit, hint=hint, width=console.size.width,
                               waves=frame_waves(watch, frame)), refresh=True)


def plain_frames(watch: BoardWatch, *, interval: float, sort: str = "rank", iterations: int = 0,
                 should_stop: Any = None, out: Any = None, max_rows: int | None = None,
                 doctor: DoctorWatch | None = None) -> None:
    """Without a terminal: a plain-text frame every ``interval`` seconds, separated by a blank line."""
    out = out or sys.stdout
    for frame in paced_frames(watch, interval=interval, iterations=iterations, should_stop=should_stop,
                              doctor=doctor):
        out.write(render_text(frame, sort=sort, max_rows=max_rows, waves=frame_waves(watch, frame)) + "\n")
        out.flush()


def paced_frames(watch: BoardWatch, *, interval: float, iterations: int = 0,
                 should_stop: Any = None, doctor: DoctorWatch | None = None) -> Iterator[Frame]:
    """A frame every ``interval`` seconds (time spent showing one counts against the wait), until
    ``iterations`` frames were shown (0: no limit) or ``should_stop()`` says so."""
    n = 0
    while True:
        started = time.monotonic()
        yield _with_doctor(watch.sample(), watch, doctor)
        n += 1
        if (iterations and n >= iterations) or (should_stop is not None and should_stop()):
            return
        time.sleep(max(0.0, interval - (time.monotonic() - started)))

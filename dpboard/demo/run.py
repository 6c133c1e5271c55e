"""``dpboard demo``: a simulated data-parallel cluster on this machine, with the live board.

It creates a board, starts N scheduler processes (``dpboard.demo.scheduler``: synthetic request and
KV page tables, published every step through the embedding API and the CPU kernels), the ZMQ
controller between them, and a load generator with bursts and a long/short prompt mix; shows
``dpboard top`` in the foreground (plain-text frames without a terminal); and on exit — the
duration is up, Ctrl-C or SIGTERM — stops every process, unlinks the board, removes its work folder
and prints a summary: requests served, p50/p99 queueing delay, the imbalance over the run and
requests per rank.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.board import Board
from dpboard.demo.reaper import remove_leftovers
from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.methods import METHOD_CHOICES, LoadBalanceMethod, resolve_load_balance_method
from dpboard.options import count, fraction, milliseconds, positive, seconds
from dpboard.processes import module_command
from dpboard.stopping import StopFlag
from dpboard.views.rows import status_of
from dpboard.views.top import render, render_text
from dpboard.views.watch import BoardWatch, Frame

MAX_RANKS = 256
SETTLE_TIMEOUT = 10.0  # seconds for in-flight requests to reach their schedulers at the end (a loaded machine)
READY_TIMEOUT = 120.0  # seconds for every scheduler to publish its first snapshot (cold Numba cache)
STOP_TIMEOUT = 5.0
COMPILE_NOTE_AFTER = 1.0  # seconds of kernel warm-up after which the demo says that Numba compiles
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=count(1, MAX_RANKS), default=8,
                   help=f"DP ranks, one scheduler process each (default 8, at most {MAX_RANKS})")
    p.add_argument("--method", default="total_tokens", choices=METHOD_CHOICES, metavar="METHOD",
                   help="load-balance method of the controller: " + ", ".join(METHOD_CHOICES)
                        + " (default total_tokens; follow_bootstrap_room gives each request a bootstrap room)")
    p.add_argument("--duration", type=seconds(), default=30.0, help="seconds of load (default 30)")
    p.add_argument("--rate", type=positive(1e6), default=None,
                   help="requests per second between bursts (default 8 per rank)")
    p.add_argument("--burst-every", type=seconds(), default=6.0, help="seconds between bursts (default 6)")
    p.add_argument("--burst-seconds", type=seconds(zero=True), default=1.0, help="length of a burst (default 1)")
    p.add_argument("--burst-factor", type=positive(1e3), default=4.0, help="rate multiplier in a burst (default 4)")
    p.add_argument("--long-share", type=fraction(), default=0.2, help="share of long prompts (default 0.2)")
    p.add_argument("--step-ms", type=milliseconds(1e5), default=20.0,
                   help="scheduler step, milliseconds (default 20)")
    p.add_argument("--num-pages", type=count(1, 1 << 24), default=4096, help="KV pages per rank (default 4096)")
    p.add_argument("--page-size", type=count(1, 1 << 16), default=16, help="tokens per KV page (default 16)")
    p.add_argument("--interval", type=seconds(), default=0.5, help="seconds between board samples (default 0.5)")
    p.add_argument("--print-every", type=seconds(), default=3.0,
                   help="without a terminal: seconds between plain-text frames (default 3)")
    p.add_argument("--board", default=None, help="board name (default demo-<pid>)")
    p.add_argument("--seed", type=count(0, 2**32 - 1), default=0,
                   help="seed of the load generator: arrivals, prompt and output lengths (default 0)")
    p.add_argument("--dp-attention", action="store_true",
                   help="the schedulers step together, as SGLang's DP attention runs ranks (a prefill step "
                        "decodes nothing; chunk 8192 / ranks) and publish their lockstep section; the "
                        "controller's auto picks inflight_lockstep then")


def _check(args: argparse.Namespace) -> None:
    from dpboard.demo.load import LoadShape

    if not 1 <= args.ranks <= MAX_RANKS:
        raise InvalidInputError(f"--ranks must be in 1..{MAX_RANKS}, got {args.ranks}")
    if not args.duration > 0:
        raise InvalidInputError(f"--duration must be > 0 seconds, got {args.duration}")
    if not args.interval > 0 or not args.step_ms > 0:
        raise InvalidInputError("--interval and --step-ms must be > 0")
    if args.num_pages < 1 or args.page_size < 1:
        raise InvalidInputError("--num-pages and --page-size must be >= 1")
    longest = LoadShape.long_prompt[1]
    if args.num_pages * args.page_size < 2 * longest:
        raise InvalidInputError(f"--num-pages x --page-size is {args.num_pages * args.page_size} tokens per rank, too small "
                         f"for the longest prompt ({longest} tokens) twice: raise --num-pages")
    resolve_load_balance_method(args.method)  # an unknown method fails here, before any process starts


# -- the run's statistics -------------------------------------------------------------------------

# Joins a figure to its label and unit while the summary is wrapped: textwrap breaks at spaces only.
_KEEP = "\N{NO-BREAK SPACE}"


def fit_lines(lines: list[str], width: int | None) -> str:
    """``lines`` joined; with ``width`` (a terminal's), each broken between its words to fit, so
    that the terminal never breaks one inside a figure; ``_KEEP`` holds words together."""
    if width is not None:
        lines = [textwrap.fill(line, max(width, 20), subsequent_indent="      ", break_long_words=False,
                               break_on_hyphens=False) for line in lines]
    return "\n".join(lines).replace(_KEEP, " ")


def terminal_width() -> int | None:
    """The terminal's width when stdout is one; None for a pipe or a file (nothing wraps there)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


@dataclass
class RunStats:
    ranks: int
    queue_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    served_by_rank: list[int] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)
    received_by_rank: list[int] = field(default_factory=list)
    sent: int = 0
    load_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.served_by_rank = [0] * self.ranks
        self.received_by_rank = [0] * self.ranks

    def add_completions(self, msg: dict[str, Any]) -> None:
        rank = int(msg["rank"])
        for rec in msg["done"]:
            self.served_by_rank[rank] += 1
            self.queue_s.append(rec["queue_s"])
            if rec.get("latency_s") is not None:
                self.latency_s.append(rec["latency_s"])

    def add_frame(self, frame: Frame) -> None:
        if frame.gone is not None:
            return
        if frame.imbalance is not None:
            self.imbalance.append(frame.imbalance)
        for row in frame.rows:
            if status_of(row).has_snapshot:
                self.received_by_rank[row["dp_rank"]] = row["num_received_reqs"]

    def _undelivered(self, method: str) -> list[str]:
        lost = self.sent - sum(self.received_by_rank)
        if lost <= 0:
            return []
        if lost == self.sent:
            return [f"  NO request reached a scheduler: the controller refused every one (method {method}); "
                    f"the run shows nothing of dispatch"]
        return [f"  {lost} of the requests sent never reached a scheduler: refused by the controller, or still "
                f"in flight when the load stopped"]

    def summary(self, method: str, width: int | None = None) -> str:
        """The run in a few lines; with ``width`` (a terminal's), each line is broken between its
        items to fit, never inside one ("p99 27.9 ms" stays whole)."""
        served = sum(self.served_by_rank)

        def pct(values: list[float], q: float) -> str:
            return f"{np.percentile(values, q) * 1e3:.1f}{_KEEP}ms" if values else "-"

        lines = [
            f"dpboard demo: {self.ranks} rank{'s' if self.ranks != 1 else ''}, method {method}, {self.load_seconds:.1f} s of load",
            f"  requests sent {self.sent}, received by schedulers {sum(self.received_by_rank)}, served {served}",
            *self._undelivered(method),
            f"  queueing delay (arrival at scheduler -> first scheduled): p50{_KEEP}{pct(self.queue_s, 50)}, "
            f"p99{_KEEP}{pct(self.queue_s, 99)}",
            f"  end-to-end latency (sent -> finished): p50{_KEEP}{pct(self.latency_s, 50)}, "
            f"p99{_KEEP}{pct(self.latency_s, 99)}",
        ]
        if self.imbalance:
            lines.append(f"  imbalance (max/mean total tokens over live ranks): mean{_KEEP}{np.mean(self.imbalance):.2f}, "
                         f"worst{_KEEP}{max(self.imbalance):.2f} over{_KEEP}{len(self.imbalance)}{_KEEP}sample{'s' if len(self.imbalance) != 1 else ''}")
        else:
            lines.append("  imbalance: no sample had load on a live rank")
        lines.append("  served per rank:   " + " ".join(f"{r}:{n}" for r, n in enumerate(self.served_by_rank)))
        lines.append("  received per rank: " + " ".join(f"{r}:{n}" for r, n in enumerate(self.received_by_rank)))
        return fit_lines(lines, width)


# -- processes -------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when the demo dies, even by SIGKILL, so
    that no scheduler or controller is left running with ppid 1 (Linux ``PR_SET_PDEATHSIG``). The
    libc call is looked up here, before the fork: the child only makes the system call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the children's own --duration bound remains
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the demo died before the signal was armed
            os._exit(1)

    return arm


class Cluster:
    """The demo's child processes: schedulers and the controller. Every one is stopped by ``stop()``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.stop_signals: dict[int, int] = {}  # pid -> what stops it, where not SIGTERM

    def start(self, label: str, argv: list[str], env: dict[str, str] | None = None, *, listed: bool = True,
              stop_signal: int = signal.SIGTERM) -> None:
        log = self.workdir / f"{label}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(module_command(*argv), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    env=env, start_new_session=True,  # Ctrl-C reaches the demo only
                                    preexec_fn=_die_with_parent(os.getpid()))
        self.procs.append((label, proc, log))
        self.stop_signals[proc.pid] = stop_signal
        if listed:  # for the reaper, which waits for them once the demo is gone
            with open(self.workdir / "pids", "a") as f:
                f.write(f"{proc.pid}\n")

    def check(self) -> None:
        """A child that died early is an error that shows its last words."""
        for label, proc, log in self.procs:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise UnavailableError(f"the demo's {label} exited with status {proc.returncode}:\n  "
                                   + "\n  ".join(tail or ["(no output)"]))

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(self.stop_signals.get(proc.pid, signal.SIGTERM))
        deadline = time.monotonic() + STOP_TIMEOUT
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)


def method_label(args: argparse.Namespace) -> str:
    """The method as the controller runs it: ``auto`` with what it resolves to."""
    if args.method != "auto":
        return args.method
    return f"auto ({resolve_load_balance_method(args.method, lockstep=args.dp_attention).value})"


def _controller_argv(args: argparse.Namespace, board: str, requests: str, schedulers: list[str]) -> list[str]:
    # --duration bounds the controller even if the demo itself is killed without a chance to stop it.
    bound = READY_TIMEOUT + args.duration + 60
    lockstep = ["--lockstep"] if args.dp_attention else []
    return ["dpboard.cli", "controller", "--input", requests, "--workers", *schedulers,
            "--method", args.method, *lockstep, "--board", board, "--duration", f"{bound:g}", "--log-every", "3600"]


def _warm_kernels() -> None:
    """Compile the CPU kernels once here (or load them from Numba's cache), so that N schedulers do not
    all compile them at once. Loading them takes a fraction of a second; a warm-up still going after
    ``COMPILE_NOTE_AFTER`` is the first run's compile, and is said as it happens: the screen would
    otherwise stay blank for as long as it takes."""
    from dpboard.loads import cpu as kernels_cpu

    done = threading.Event()
    noted = threading.Event()

    def note() -> None:
        if not done.wait(COMPILE_NOTE_AFTER):
            # a cold cache's first line: broken to the terminal's width like the demo's other lines
            print(fit_lines(["dpboard demo: Numba is compiling the load kernels (the first run on this machine; "
                             "cached for the next ones) ..."], terminal_width()), flush=True)
            noted.set()

    started = time.monotonic()
    notice = threading.Thread(target=note, daemon=True)
    notice.start()
    try:
        kernels_cpu.warm_up((np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.int8)))
    finally:
        done.set()
        notice.join()
    if noted.is_set():
        print(f"dpboard demo: kernels compiled in {time.monotonic() - started:.0f} s", flush=True)


class DemoRun:
    """One demo: its board, work folder, processes and sockets, set up and torn down in one place.

    ``run()`` goes through the phases in order (start the cluster, wait for every scheduler's first
    publish, send load while showing the board) and, whatever ends it — the duration, Ctrl-C,
    SIGTERM, a child that died — stops every process, unlinks the board and removes the work folder.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import zmq

        from dpboard.demo.load import LoadShape

        self.args = args
        self.shape = LoadShape(rate=args.rate or 8.0 * args.ranks, burst_every=args.burst_every,
                               burst_seconds=args.burst_seconds, burst_factor=args.burst_factor,
                               long_share=args.long_share)
        self.name = args.board or f"demo-{os.getpid()}"
        self.stats = RunStats(args.ranks)
        self.workdir = Path(tempfile.mkdtemp(prefix="dpboard-demo-"))
        self.requests_ep = f"ipc://{self.workdir}/requests"
        self.results_ep = f"ipc://{self.workdir}/results"
        self.sched_eps = [f"ipc://{self.workdir}/rank{r}" for r in range(args.ranks)]
        self.cluster = Cluster(self.workdir)
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.board: Board | None = None
        self.generator: Any = None
        self.watch: BoardWatch | None = None
        self.started = time.monotonic()

    # -- phases ------------------------------------------------------------------------------------

    def start_cluster(self) -> None:
        args = self.args
        self.board = Board.create(self.name, n_slots=args.ranks)
        # First: whatever kills the demo from now on (SIGKILL too), the reaper removes what it leaves.
        self.cluster.start("reaper", ["dpboard.demo.reaper", "--parent", str(os.getpid()), "--board", self.name,
                                      "--generation", str(self.board.generation), "--workdir", str(self.workdir),
                                      "--requests", self.requests_ep], listed=False, stop_signal=signal.SIGUSR1)
        self.results.bind(self.results_ep)
        env = {**os.environ, "NUMBA_NUM_THREADS": "1"}  # N schedulers share the cores: one thread each
        for r in range(args.ranks):
            self.cluster.start(f"scheduler-{r}", [
                "dpboard.demo.scheduler", "--board", self.name, "--rank", str(r), "--requests",
                self.sched_eps[r], "--results", self.results_ep, "--num-pages", str(args.num_pages),
                "--page-size", str(args.page_size), "--step-ms", str(args.step_ms), "--seed", str(args.seed),
                *(["--dp-attention"] if args.dp_attention else [])],
                env=env)
        self.cluster.start("controller", _controller_argv(args, self.name, self.requests_ep, self.sched_eps),
                           env=env)

    def wait_ready(self, stop: StopFlag) -> bool:
        """Every scheduler has published once (True), or the demo was stopped first (False)."""
        assert self.board is not None
        reader = self.board.reader(stale_after=5.0)
        n = self.args.ranks
        print(fit_lines([f"dpboard demo: waiting for the first publish of {n} scheduler "
                         f"process{'es' if n != 1 else ''} ..."], terminal_width()), flush=True)
        deadline = time.monotonic() + READY_TIMEOUT
        while any(s is None for s in reader.read_all()):
            self.cluster.check()
            if time.monotonic() > deadline:
                raise UnavailableError(f"the schedulers did not all publish within {READY_TIMEOUT:.0f} s; "
                                       f"their logs are in {self.workdir}")
            if stop.wait(0.05):
                return False
        return True

    def send_load(self, stop: StopFlag) -> None:
        """Start the load generator and show the board until the duration is up or a stop comes."""
        from rich.console import Console
        from rich.live import Live

        from dpboard.demo.load import LoadGenerator

        args = self.args
        self.watch = BoardWatch(self.name, stale_after=1.0)
        self.started = time.monotonic()
        rooms = resolve_load_balance_method(args.method) is LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM
        self.generator = LoadGenerator(self.requests_ep, self.shape, seed=args.seed, context=self.ctx,
                                       bootstrap_rooms=rooms)
        self.generator.start()
        end = self.started + args.duration
        console = Console()
        if console.is_terminal:
            hint = f"demo: {args.method}, {self.shape.rate:g} req/s, ends in {{left:.0f}} s (Ctrl-C stops it)"
            with Live(console=console, screen=True, auto_refresh=False) as live:
                while (now := time.monotonic()) < end and not stop.is_set():
                    frame = self._tick()
                    # The width, as top passes it: at 80 columns the table then drops whole columns
                    # instead of cutting every heading to an ellipsis.
                    live.update(render(frame, max_rows=max(console.size.height - 7, 1),
                                       hint=hint.format(left=end - now), width=console.size.width),
                                refresh=True)
                    stop.wait(min(args.interval, max(0.0, end - time.monotonic())))
            return
        next_print = self.started
        while (now := time.monotonic()) < end and not stop.is_set():
            frame = self._tick()
            if now >= next_print:
                sys.stdout.write(render_text(frame) + "\n")
                sys.stdout.flush()
                next_print = now + args.print_every
            stop.wait(min(args.interval, max(0.0, end - time.monotonic())))

    def _tick(self) -> Frame:
        assert self.watch is not None
        self.cluster.check()
        self._drain()
        frame = self.watch.sample()
        self.stats.add_frame(frame)
        return frame

    def _drain(self) -> None:
        import msgpack
        import zmq

        while True:
            try:
                self.stats.add_completions(msgpack.unpackb(self.results.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return

    # -- teardown ----------------------------------------------------------------------------------

    def finish_load(self) -> None:
        """Stop the generator and count what it sent, once the schedulers have received it."""
        if self.generator is None:
            return
        self.generator.stop()
        self.generator.join(timeout=STOP_TIMEOUT)
        self.stats.sent = self.generator.sent
        self.stats.load_seconds = time.monotonic() - self.started
        if self.watch is not None and self.board is not None:
            _settle(self.board, self.generator.sent)
            self.stats.add_frame(self.watch.sample())

    def close(self) -> None:
        """Stop every process, close every socket, remove the board and the work folder."""
        try:
            self.cluster.stop()
            self._drain()
        finally:
            self.results.close(0)
            self.ctx.term()
            if self.watch is not None:
                self.watch.close()
            if self.board is not None:
                self.board.close()
                self.board.unlink()
            # what a child killed past its stop timeout could not remove (every child is waited for)
            remove_leftovers(self.name, self.requests_ep)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self) -> int:
        with StopFlag() as stop:
            try:
                self.start_cluster()
                if self.wait_ready(stop):
                    self.send_load(stop)
            except KeyboardInterrupt:
                stop.set()
            finally:
                try:
                    self.finish_load()
                finally:
                    self.close()
        if stop.signal is not None:
            how = "Ctrl-C" if stop.signal == signal.SIGINT else signal.Signals(stop.signal).name
            print(f"dpboard demo: stopped by {how}", file=sys.stderr)
        print(self.stats.summary(method_label(self.args), terminal_width()), flush=True)
        hint = path_hint()
        if hint:
            print(fit_lines(hint.splitlines(), terminal_width()), flush=True)
        return 0


def path_hint() -> str | None:
    """How to run ``dpboard`` by name next time, when the folder it runs from is not on PATH (as
    after ``make demo``, which runs .venv/bin/dpboard); None when it is."""
    bin_dir = Path(sys.executable).parent
    script = bin_dir / "dpboard"
    found = shutil.which("dpboard")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return None
    try:
        shown = bin_dir.relative_to(Path.cwd())
    except ValueError:
        shown = bin_dir
    activate = shown / "activate"
    how = f"`. {activate}` puts it there" if (bin_dir / "activate").exists() else f"add {shown} to PATH"
    return (f"dpboard demo: the dpboard command is {shown / 'dpboard'}, not on PATH:\n"
            f"  {how} (or run {shown / 'dpboard'} itself)")


def run_demo(args: argparse.Namespace) -> int:
    _check(args)
    demo = DemoRun(args)
    print(fit_lines([f"dpboard demo: board {demo.name!r}, {args.ranks}{_KEEP}rank{'s' if args.ranks != 1 else ''}, "
                     f"method {method_label(args)}, {demo.shape.rate:g}{_KEEP}req/s "
                     f"(x{demo.shape.burst_factor:g} bursts), {args.duration:g}{_KEEP}s"], terminal_width()), flush=True)
    _warm_kernels()
    return demo.run()


def _settle(board: Board, sent: int) -> None:
    """Waits (bounded) until the schedulers have received every request sent, so that the summary
    does not count the last few milliseconds' requests as missing."""
    reader = board.reader(stale_after=5.0)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while time.monotonic() < deadline:
        if sum(s.num_received_reqs for s in reader.read_all() if s is not None) >= sent:
            return
        time.sleep(0.02)

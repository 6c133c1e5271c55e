"""The seqlock's barriers on aarch64, checked from x86, in order.

Every C file of the extension dpboard.board._seqlock (as setup.py lists them, compiled with its
flags) is compiled for aarch64 with Debian's cross compiler, with line information (-g, which does
not change the code; Python's own CFLAGS build the extension with it too). dpb_seqlock.h marks each
access of the seqlock with a comment on the line that makes it: [W0] the odd sequence store, [W1]
the release fence, [WD] a data store, [W2] the even sequence store (a release), [R1] the first
sequence load (an acquire), [RD] a data load, [R2] the acquire fence, [R3] the second sequence load.
An instruction is one of these when the assembler's line information puts it on a marked line and
it is the right kind (a store, a load, a `dmb`/`dsb`).

Every function of the assembly that makes a marked access, or calls one of its file that does
(GCC may or may not inline it), is a seqlock writer or reader: found here, in no list. On every
path through it (calls to such functions followed into them, per call), the checker asks:

  writer  [W1] a full fence (`dmb ish`, or stronger: `dmb sy`, `dsb`) between [W0] and every [WD]
          that follows it, and before the return (SeqRow.begin: the caller's stores come next);
          every [WD] before [W2], which releases (`stlr`), or else a full fence lies between;
          no [WD] after [W2] without a new [W0], and no [W0] between a [WD] and its [W2] (a
          function may start inside a write, as SeqRow.add does between begin and end);
  reader  every [RD] after an [R1], which acquires (`ldar`, `ldapr`), or else a load fence lies
          between; a load fence [R2] (`dmb ishld`, or stronger: `dmb ish`, `dmb sy`) between every
          [RD] and [R3]; every [RD] followed by an [R3] that checks it; no [RD] after [R3] without a
          new [R1].

x86-64 needs none of these barriers (TSO), so this is the one test on an x86 machine that fails when
one is lost or moved. The mutation runs below copy the sources, move a fence (or make it stronger,
or add a writer or reader of their own), compile the copy and assert what the checker says of it.
Two scans of the source keep the finding honest: the module's C files store and fence only through
dpb_seqlock.h (so every access a reader races with is marked), and each method that calls the
seqlock's helpers in the source is a writer or reader the assembly scan found.

Without aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu) and its C library headers
(libc6-dev-arm64-cross) the tests skip and say so; in CI (CI set) they fail instead.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sysconfig
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CC = "aarch64-linux-gnu-gcc"
MODULE = "dpboard.board._seqlock"
HEADER = "dpboard/board/dpb_seqlock.h"

# a marked access: code, then the mark alone in a comment at the end of the line
MARK = re.compile(r"^\s*[^\s/*].*/\*\s*\[(W0|W1|WD|W2|R1|RD|R2|R3)\]\s*\*/\s*$")
STORE_MARKS, LOAD_MARKS = {"W0", "WD", "W2"}, {"R1", "RD", "R3"}  # [W1], [R2]: fences
FULL_FENCE = {"sy", "ish", "osh"}  # orders every earlier access before every later one
LOAD_FENCE = {"ld", "ishld", "oshld"}  # earlier loads before every later access
CALL_DEPTH = 4
EXIT = -1  # the return to the caller, as a node


# ------------------------------------------------------------------------------------------------
# Compiling


@dataclass(frozen=True)
class Extension:
    sources: tuple[str, ...]  # relative to the tree
    include_dirs: tuple[str, ...]
    flags: tuple[str, ...]


def extension() -> Extension:
    """The extension as setup.py declares it: its sources, include directories and flags."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    consts = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.List)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"
                and ast.literal_eval(node.args[0]) == MODULE):
            kw = {k.arg: k.value for k in node.keywords}
            flags = kw["extra_compile_args"]
            return Extension(tuple(ast.literal_eval(node.args[1])), tuple(ast.literal_eval(kw["include_dirs"])),
                             tuple(consts[flags.id] if isinstance(flags, ast.Name) else ast.literal_eval(flags)))
    raise AssertionError(f"setup.py declares no Extension({MODULE!r}, ...)")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must check the seqlock's aarch64 barriers: {reason}")
    pytest.skip(reason)


def cross_compile(tree: Path, out: Path) -> dict[str, str]:
    """Each source of the extension in `tree` (the repository, or a copy) as aarch64 assembly, by file."""
    if shutil.which(CC) is None:
        _unavailable(f"{CC} is not installed: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross")
    ext = extension()
    includes = [arg for d in ext.include_dirs for arg in ("-I", str(tree / d))]
    out.mkdir(parents=True, exist_ok=True)

    def one(source: str) -> str:
        target = out / (Path(source).stem + ".s")
        cmd = [CC, *ext.flags, "-g", "-fPIC", "-S", *includes, "-I", sysconfig.get_paths()["include"],
               str(tree / source), "-o", str(target)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            if "No such file or directory" in done.stderr and "#include <" in done.stderr:
                _unavailable(f"{CC} has no aarch64 C library headers: apt-get install libc6-dev-arm64-cross "
                             f"({done.stderr.strip().splitlines()[-1]})")
            pytest.fail(f"{' '.join(cmd)} failed:\n{done.stderr}")
        return target.read_text()

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(ext.sources, pool.map(one, ext.sources), strict=True))


# ------------------------------------------------------------------------------------------------
# Reading the assembly


@dataclass
class Ins:
    op: str
    args: list[str]
    where: str  # file:line
    mark: str | None  # the seqlock access it makes, if any

    @property
    def fence(self) -> str | None:
        return self.args[0] if self.op in ("dmb", "dsb") and self.args else None

    def __str__(self) -> str:
        return f"{self.op} {', '.join(self.args)}".strip() + f" ({self.mark or '-'} at {self.where})"


@dataclass
class Unit:
    """One file's assembly: its instructions, where each function's body lies, its labels."""
    ins: list[Ins] = field(default_factory=list)
    bodies: dict[str, range] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    body_of: list[str] = field(default_factory=list)


def _is_store(op: str) -> bool:
    return op.startswith(("st", "swp", "cas")) or re.match(r"ld(add|clr|eor|set|smax|smin|umax|umin)", op) is not None


def _is_load(op: str) -> bool:
    return op.startswith("ld")


def _kind_fits(mark: str, op: str) -> bool:
    if mark in STORE_MARKS:
        return _is_store(op)
    if mark in LOAD_MARKS:
        return _is_load(op)
    return op in ("dmb", "dsb")


def _marks_of(path: Path, cache: dict[Path, dict[int, str]]) -> dict[int, str]:
    if path not in cache:
        cache[path] = {}
        if path.is_file():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                m = MARK.match(line)
                if m:
                    cache[path][number] = m.group(1)
    return cache[path]


def parse(asm: str, tree: Path) -> Unit:
    unit, files, marks = Unit(), {}, {}
    loc: tuple[Path | None, int] = (None, 0)
    types: set[str] = set()
    current: str | None = None
    start = 0
    for raw in asm.splitlines():
        line = raw.split("//")[0].rstrip()
        if not line:
            continue
        words = line.split()
        if words[0] == ".file" and len(words) >= 3 and words[1].isdigit():
            names = re.findall(r'"([^"]*)"', line)
            files[words[1]] = Path(names[0], names[1]) if len(names) == 2 else Path(names[0])
        elif words[0] == ".loc":
            loc = (files.get(words[1]), int(words[2]))
        elif words[0] == ".type" and words[-1] == "%function":
            types.add(words[1].rstrip(","))
        elif words[0] == ".size" and current is not None and words[1].rstrip(",") == current:
            unit.bodies[current] = range(start, len(unit.ins))
            current = None
        elif not raw[0].isspace() and line.endswith(":"):
            label = line[:-1]
            unit.labels[label] = len(unit.ins)
            if label in types and current is None:
                current, start = label, len(unit.ins)
        elif raw[0].isspace() and not words[0].startswith("."):
            op = words[0].lower()
            args = [a.strip() for a in line.strip()[len(words[0]):].split(",")] if len(words) > 1 else []
            path, number = loc
            mark = None
            if path is not None:
                resolved = path.resolve()
                if resolved.is_relative_to(tree.resolve()):
                    mark = _marks_of(resolved, marks).get(number)
                where = f"{resolved.name}:{number}"
            else:
                where = "?"
            unit.ins.append(Ins(op, args, where, mark if mark and _kind_fits(mark, op) else None))
            unit.body_of.append(current or "")
    return unit


# ------------------------------------------------------------------------------------------------
# Paths


CONDITIONAL = re.compile(r"(b\.?|bc\.)(eq|ne|cs|hs|cc|lo|mi|pl|vs|vc|hi|ls|ge|lt|gt|le|al|nv)|cbn?z|tbn?z")
NOT_BRANCHES = {"bic", "bics", "bfi", "bfxil", "bfm", "bfc", "bif", "bit", "bsl", "bti", "blr", "blraa", "blrab",
                "blraaz", "blrabz"}  # the last: calls through a pointer, which return here


def _branch_target(ins: Ins) -> str | None:
    """Where a jump may go (b, b.cond or bcond, cbz, tbz, ...): the label; None for other instructions."""
    if ins.op == "b" or CONDITIONAL.fullmatch(ins.op):
        return ins.args[-1]
    if ins.op.startswith("b") and ins.op not in NOT_BRANCHES | {"bl", "br", "braa", "brab", "braaz", "brabz", "brk"}:
        raise AssertionError(f"the checker does not know where {ins} goes: teach _branch_target")
    return None


class Paths:
    """The control flow of one function, with the calls to its file's seqlock functions followed
    into them (a node is an instruction and the call sites it was reached through)."""

    def __init__(self, unit: Unit, name: str, seqlock: set[str]):
        self.unit, self.name, self.seqlock = unit, name, seqlock
        self.entry = (unit.bodies[name].start, ())

    def successors(self, node):
        i, ctx = node
        unit = self.unit
        ins = unit.ins[i]
        body = unit.bodies[unit.body_of[i]] if unit.body_of[i] else range(0)

        def ret():
            return [(ctx[-1], ctx[:-1])] if ctx else [EXIT]

        def fall():
            return [(i + 1, ctx)] if i + 1 in body else ret()

        target = _branch_target(ins)
        if ins.op == "bl":
            callee = ins.args[0]
            if callee in self.seqlock and callee in unit.bodies and len(ctx) < CALL_DEPTH:
                return [(unit.bodies[callee].start, (*ctx, i + 1))]
            return fall()
        if ins.op.startswith("ret") or ins.op == "eret":
            return ret()
        if ins.op in ("brk", "udf", "hlt"):
            return []  # a trap (__builtin_trap): no path goes on
        if ins.op in ("br", "braa", "brab", "braaz", "brabz"):
            # a jump table or a tail call through a pointer: anywhere in the function, or out of it
            return [(unit.labels[lab], ctx) for lab in unit.labels if unit.labels[lab] in body] + ret()
        if target is not None:
            if target in unit.labels and not (target in unit.bodies and target != unit.body_of[i]):
                dest = [(unit.labels[target], ctx)]
            elif target in self.seqlock and target in unit.bodies:
                dest = [(unit.bodies[target].start, ctx)]  # a tail call: its return is ours
            else:
                dest = ret()  # a tail call out of the file
            return dest if ins.op == "b" else dest + fall()
        return fall()

    def nodes(self) -> set:
        seen, todo = {self.entry}, [self.entry]
        while todo:
            for nxt in self.successors(todo.pop()):
                if nxt != EXIT and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def first(self, start, blocked, target, include_start=False):
        """The first node of `target` on a path from `start` that meets no `blocked` node, or None."""
        if include_start and target(start):
            return start
        if include_start and blocked(start):
            return None
        seen, todo = {start}, deque([start])
        while todo:
            for nxt in self.successors(todo.popleft()):
                if nxt in seen:
                    continue
                seen.add(nxt)
                if target(nxt):
                    return nxt
                if nxt != EXIT and not blocked(nxt):
                    todo.append(nxt)
        return None


# ------------------------------------------------------------------------------------------------
# The check


@dataclass
class Report:
    functions: dict[str, str]  # "file:function" -> "writer", "reader", "writer and reader"
    violations: list[str]

    def rules_broken(self) -> set[str]:
        return {v.split("] ", 1)[0].split("[", 1)[1] for v in self.violations}


def check(asm_by_file: dict[str, str], tree: Path) -> Report:
    functions, violations = {}, []
    for source, asm in asm_by_file.items():
        unit = parse(asm, tree)
        marked = {name for name, body in unit.bodies.items() if any(unit.ins[i].mark for i in body)}
        calls = {name: {unit.ins[i].args[0] for i in body if unit.ins[i].op in ("bl", "b") and unit.ins[i].args}
                 for name, body in unit.bodies.items()}
        seqlock = set(marked)
        while True:  # and every function that calls one of them
            more = {name for name, callees in calls.items() if callees & seqlock} - seqlock
            if not more:
                break
            seqlock |= more
        for name in sorted(seqlock):
            if name.endswith(".cold") or ".cold." in name:
                continue  # entered only from its function
            kinds, broken = _check_function(unit, name, seqlock)
            functions[f"{Path(source).name}:{name}"] = " and ".join(kinds)
            violations += [f"{Path(source).name}:{name}: {b}" for b in broken]
    return Report(functions, violations)


def _check_function(unit: Unit, name: str, seqlock: set[str]) -> tuple[list[str], list[str]]:
    paths = Paths(unit, name, seqlock)
    nodes = paths.nodes()

    def ins(node) -> Ins | None:
        return None if node == EXIT else unit.ins[node[0]]

    def has(*marks):
        return lambda node: node != EXIT and unit.ins[node[0]].mark in marks

    def fence_in(options):
        return lambda node: node != EXIT and unit.ins[node[0]].fence in options

    def either(*preds):
        return lambda node: any(p(node) for p in preds)

    def at(node) -> str:
        return "the return" if node == EXIT else str(unit.ins[node[0]])

    def release(node) -> bool:
        return node != EXIT and unit.ins[node[0]].mark == "W2" and unit.ins[node[0]].op.startswith("stl")

    def acquire(node) -> bool:
        return unit.ins[node[0]].op.startswith(("ldar", "ldapr", "ldapur", "ldaxr", "ldaxp"))

    is_exit = lambda node: node == EXIT  # noqa: E731
    never = lambda node: False  # noqa: E731
    full, load_fence = fence_in(FULL_FENCE), fence_in(FULL_FENCE | LOAD_FENCE)
    of = {m: sorted(n for n in nodes if ins(n).mark == m) for m in ("W0", "WD", "W2", "R1", "RD", "R3")}
    marks_here = {ins(n).mark for n in nodes} - {None}
    kinds = [k for k, ms in (("writer", {"W0", "W1", "WD", "W2"}), ("reader", {"R1", "RD", "R2", "R3"}))
             if marks_here & ms]
    broken = []

    def rule(tag, starts, blocked, target, says, include_start=False):
        for start in starts:
            hit = paths.first(start, blocked, target, include_start)
            if hit is not None:
                broken.append(f"[{tag}] {says}: {at(start)} -> {at(hit)}")
                return

    if "writer" in kinds:
        rule("W1", of["W0"], either(full, has("W2")), either(has("WD"), is_exit),
             "the odd store [W0] reaches a data store (or the return) with no full fence [W1] between")
        rule("W2", [paths.entry, *of["WD"]], either(full, release), lambda n: has("W2")(n) and not release(n),
             "a data store reaches a plain even store [W2]: not a release, and no full fence between",
             include_start=True)
        rule("W2-after", of["W2"], has("W0"), has("WD"),
             "a data store after the even store [W2], with no new odd store [W0] between")
        rule("W0-before", of["WD"], has("W2"), has("W0"),
             "a data store before the odd store [W0] of its write")
    if "reader" in kinds:
        rule("R1", [paths.entry], has("R1"), has("RD"), "a data load with no first sequence load [R1] before it",
             include_start=True)
        rule("R1-acquire", [n for n in of["R1"] if not acquire(n)], load_fence, has("RD"),
             "the first sequence load [R1] does not acquire, and no fence lies before the data load")
        rule("R2", of["RD"], load_fence, has("R3"),
             "a data load reaches the second sequence load [R3] with no load fence [R2] between")
        rule("R3-after", of["R3"], has("R1"), has("RD"),
             "a data load after the second sequence load [R3], with no new [R1] between")
        for start in of["RD"]:
            if paths.first(start, never, has("R3")) is None:
                broken.append(f"[R3] a data load that no second sequence load [R3] checks: {at(start)}")
                break
    return kinds, broken


# ------------------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def tree_report(tmp_path_factory) -> Report:
    out = tmp_path_factory.mktemp("aarch64")
    return check(cross_compile(ROOT, out), ROOT)


def test_every_seqlock_writer_and_reader_has_its_barriers_in_order(tree_report):
    assert not tree_report.violations, ("seqlock barriers missing or out of order on aarch64 (see dpb_seqlock.h):\n"
                                        + "\n".join(tree_report.violations))


def test_the_writers_and_readers_are_found_in_their_files(tree_report):
    """The scan finds them by their marked accesses: the board's writer and reader, the side rows'
    writer and reader; the owner claim and the module itself are neither."""
    kinds: dict[str, set[str]] = {}
    for key, kind in tree_report.functions.items():
        kinds.setdefault(key.split(":")[0], set()).update(kind.split(" and "))
    assert kinds.get("slot_writer.c") == {"writer"}, tree_report.functions
    assert kinds.get("board_reader.c") == {"reader"}, tree_report.functions
    assert kinds.get("side_rows.c") == {"writer", "reader"}, tree_report.functions
    assert "claim.c" not in kinds and "board_module.c" not in kinds, tree_report.functions


SEQLOCK_CALL = re.compile(r"\b(dpb_seq_\w+|dpb_read_row|dpb_store_words?|dpb_load_words)\(")
DEFINITION = re.compile(r"^(?:[A-Za-z_][\w ]*[\w*])\s*\*?\b(\w+)\([^;]*?\)\s*\{", re.M | re.S)
METHOD = re.compile(r"\((?:PyCFunction|getter|setter|initproc)\)(?:\(void \(\*\)\(void\)\))?(\w+)")


def test_every_method_that_uses_the_seqlock_in_the_source_is_found_in_the_assembly(tree_report):
    """A second scan, of the C source: each function of a method table whose body calls the
    seqlock's helpers (itself or through a function of its file) is a writer or reader the
    assembly scan found, and the assembly scan finds nothing that the source does not use."""
    for source in extension().sources:
        text = (ROOT / source).read_text()
        starts = [(m.group(1), m.start()) for m in DEFINITION.finditer(text)]
        bodies = {name: text[at:nxt] for (name, at), (_, nxt) in zip(starts, [*starts[1:], ("", len(text))],
                                                                      strict=True)}
        uses = {name for name, body in bodies.items() if SEQLOCK_CALL.search(body)}
        while True:
            more = {name for name, body in bodies.items()
                    if any(re.search(rf"\b{u}\(", body) for u in uses)} - uses
            if not more:
                break
            uses |= more
        found = {key.split(":", 1)[1].split(".")[0] for key in tree_report.functions
                 if key.startswith(Path(source).name + ":")}
        methods = set(METHOD.findall(text))
        assert (uses & methods) <= found, f"{source}: used in the source, not found: {sorted((uses & methods) - found)}"
        assert found <= uses, f"{source}: found in the assembly, not in the source: {sorted(found - uses)}"


OWN_ORDERING = re.compile(r"__atomic_(store|exchange|fetch_|thread_fence|signal_fence)|__atomic_\w+_fetch|__sync_|"
                          r"\batomic_(store|exchange|fetch_|thread_fence)|\bdmb\b|\bstlr\b")


def test_the_module_stores_and_fences_only_through_the_header():
    """The checker sees the accesses that dpb_seqlock.h marks: the module's C files make no store or
    fence of their own that a reader races with (their atomic loads read a writer's own words or the
    sequence for a getter; claim.c's compare-and-swap is the owner word's, outside the seqlock)."""
    own = [f"{source}:{number}: {line.strip()}" for source in extension().sources
           for number, line in enumerate((ROOT / source).read_text().splitlines(), 1) if OWN_ORDERING.search(line)]
    assert not own, "stores or fences outside dpb_seqlock.h, which the aarch64 check would not see:\n" + "\n".join(own)


def test_every_marked_line_is_an_access_of_its_kind():
    """A mark on a line that makes no such access would find nothing: each of dpb_seqlock.h's marks
    is on a line that is there, once per access of the argument."""
    marks = [m.group(1) for line in (ROOT / HEADER).read_text().splitlines() if (m := MARK.match(line))]
    assert sorted(marks) == sorted(["W0", "W1", "W2", "WD", "R1", "RD", "R2", "R3"]), marks


# Each mutation: the file, the text replaced, its replacement, and the rules the checker must say are
# broken (an empty set: the mutant is as correct as the original, or more strongly fenced).
OPEN = """    __atomic_store_n(seq, odd, __ATOMIC_RELAXED); /* [W0] */
    __atomic_thread_fence(__ATOMIC_RELEASE);      /* [W1] */"""
CLOSE = "    __atomic_store_n(seq, odd + 1, __ATOMIC_RELEASE); /* [W2] */"
READ_BEGIN = "    return __atomic_load_n(seq, __ATOMIC_ACQUIRE); /* [R1] */"
READ_END = """    __atomic_thread_fence(__ATOMIC_ACQUIRE);              /* [R2] */
    return __atomic_load_n(seq, __ATOMIC_RELAXED) == s1; /* [R3] */"""

MUTATIONS = {
    "writer fence [W1] before the odd store": (HEADER, [(OPEN, """\
    __atomic_thread_fence(__ATOMIC_RELEASE);      /* [W1] */
    __atomic_store_n(seq, odd, __ATOMIC_RELAXED); /* [W0] */""")], {"W1"}),
    "writer fence [W1] after the data stores (moved from open to close)": (HEADER, [
        (OPEN, "    __atomic_store_n(seq, odd, __ATOMIC_RELAXED); /* [W0] */"),
        (CLOSE, "    __atomic_thread_fence(__ATOMIC_RELEASE);          /* [W1] */\n" + CLOSE)], {"W1"}),
    "writer's [W2] release moved after the even store (a relaxed store, then the fence)": (HEADER, [(CLOSE, """\
    __atomic_store_n(seq, odd + 1, __ATOMIC_RELAXED); /* [W2] */
    __atomic_thread_fence(__ATOMIC_RELEASE);          /* [W1] */""")], {"W2"}),
    "reader fence [R2] after the second load": (HEADER, [(READ_END, """\
    uint64_t s2 = __atomic_load_n(seq, __ATOMIC_RELAXED); /* [R3] */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);              /* [R2] */
    return s2 == s1;""")], {"R2"}),
    "reader fence [R2] before the data loads (moved into read_begin)": (HEADER, [
        (READ_BEGIN, """\
    uint64_t s1 = __atomic_load_n(seq, __ATOMIC_ACQUIRE); /* [R1] */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);              /* [R2] */
    return s1;"""),
        (READ_END, "    return __atomic_load_n(seq, __ATOMIC_RELAXED) == s1; /* [R3] */")], {"R2"}),
    "reader's [R1] acquire moved before the first load (a fence, then a relaxed load)": (HEADER, [(READ_BEGIN, """\
    __atomic_thread_fence(__ATOMIC_ACQUIRE);       /* [R2] */
    return __atomic_load_n(seq, __ATOMIC_RELAXED); /* [R1] */""")], {"R1-acquire"}),
    "a new writer, in no list, whose [W2] comes before its data store": ("dpboard/board/slot_writer.c", [
        ("PyTypeObject SlotWriterType = {", """\
void dpb_mutant_writer(uint64_t *row, uint64_t v);
void dpb_mutant_writer(uint64_t *row, uint64_t v) {
    uint64_t odd = dpb_seq_begin(row);
    dpb_seq_close(row, odd);
    dpb_store_word(row + 1, v);
}

PyTypeObject SlotWriterType = {""")], {"W2-after"}),
    "a new reader, in no list, that checks its copy without [R2] and [R3]": ("dpboard/board/board_reader.c", [
        ("PyTypeObject BoardViewType = {", """\
int dpb_mutant_reader(const uint64_t *row, uint64_t *out);
int dpb_mutant_reader(const uint64_t *row, uint64_t *out) {
    uint64_t s1 = dpb_seq_read_begin(row);
    dpb_load_words(out, row + 1, 2);
    return __atomic_load_n(row, __ATOMIC_RELAXED) == s1;
}

PyTypeObject BoardViewType = {""")], {"R3"}),
    # stronger or equivalent: accepted
    "every ordering seq_cst (stronger fences: dmb ish for [R2])": (HEADER, [
        (OPEN, OPEN.replace("__ATOMIC_RELAXED", "__ATOMIC_SEQ_CST").replace("__ATOMIC_RELEASE", "__ATOMIC_SEQ_CST")),
        (CLOSE, CLOSE.replace("__ATOMIC_RELEASE", "__ATOMIC_SEQ_CST")),
        (READ_BEGIN, READ_BEGIN.replace("__ATOMIC_ACQUIRE", "__ATOMIC_SEQ_CST")),
        (READ_END, READ_END.replace("__ATOMIC_ACQUIRE", "__ATOMIC_SEQ_CST").replace("__ATOMIC_RELAXED",
                                                                                     "__ATOMIC_SEQ_CST"))], set()),
    "both fences dmb sy": (HEADER, [
        (OPEN, OPEN.replace("__atomic_thread_fence(__ATOMIC_RELEASE);", '__asm__ volatile("dmb sy" ::: "memory");')),
        (READ_END, READ_END.replace("__atomic_thread_fence(__ATOMIC_ACQUIRE);",
                                    '__asm__ volatile("dmb sy" ::: "memory");'))], set()),
    "[W2] and [R1] as a fence and a relaxed access (C11-equivalent)": (HEADER, [
        (CLOSE, """\
    __atomic_thread_fence(__ATOMIC_RELEASE);          /* [W1] */
    __atomic_store_n(seq, odd + 1, __ATOMIC_RELAXED); /* [W2] */"""),
        (READ_BEGIN, """\
    uint64_t s1 = __atomic_load_n(seq, __ATOMIC_RELAXED); /* [R1] */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);              /* [R2] */
    return s1;""")], set()),
}


def mutant_report(tmp_path: Path, path: str, edits: list[tuple[str, str]]) -> Report:
    """The checker's report on a copy of the extension's sources with `edits` made to `path`."""
    tree = tmp_path / "tree"
    ext = extension()
    for name in {*ext.sources, HEADER, "dpboard/board/board_module.h"}:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tree / name)
    for d in ext.include_dirs:  # the generated layout header
        if not (tree / d).exists():
            shutil.copytree(ROOT / d, tree / d)
    text = (tree / path).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{path} no longer holds, once, the text this mutation changes:\n{old}"
        text = text.replace(old, new)
    (tree / path).write_text(text)
    return check(cross_compile(tree, tmp_path / "asm"), tree)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_moved_fence_is_rejected_and_a_stronger_one_accepted(mutation, tmp_path):
    path, edits, expected = MUTATIONS[mutation]
    report = mutant_report(tmp_path, path, edits)
    print(f"\n{mutation}: {len(report.violations)} functions rejected", *report.violations[:3], sep="\n  ")
    assert report.rules_broken() == expected, "\n".join(report.violations) or "accepted"
    if "new" in mutation:  # found by the scan, in no list
        assert any("dpb_mutant_" in v for v in report.violations), report.violations

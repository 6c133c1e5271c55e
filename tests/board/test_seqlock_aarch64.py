"""The seqlock's barriers on aarch64, checked from x86: _seqlock.c (with dpb_seqlock.h) is compiled
for aarch64 with Debian's cross compiler, as setup.py compiles it (-O2 -std=c11), and every writer
and reader the module exports must carry the instructions the memory-ordering argument in
dpb_seqlock.h needs: a writer `dmb ish` ([W1], the release fence after the odd store) and `stlr`
([W2], the even store); a reader `ldar` ([R1]) and `dmb ishld` ([R2]). x86-64 needs none of them
(TSO), so this is the one test on an x86 machine that fails when a fence is lost.

Without aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu) and its C library headers
(libc6-dev-arm64-cross) the test skips and says so; in CI (CI set) it fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CC = "aarch64-linux-gnu-gcc"
SOURCE = ROOT / "dpboard" / "board" / "_seqlock.c"

W1, W2, R1, R2 = "dmb ish", "stlr", "ldar", "dmb ishld"
# Every function of the module that writes or reads a seqlocked row or slot (its methods and
# functions, as its method tables name them), with what the argument needs in it, counting what
# it calls in the same file (GCC may or may not inline a helper).
SLOT_WRITERS = ("writer_publish", "writer_publish_values", "writer_publish_relayed", "writer_publish_paused",
                "writer_retire")
SLOT_READERS = ("view_read", "view_read_with_status", "view_status", "view_read_all", "view_read_array",
                "view_read_detailed", "view_read_detailed_array")
NEEDS: dict[str, tuple[str, ...]] = {
    # board slots
    **dict.fromkeys(SLOT_WRITERS, (W1, W2)),
    **dict.fromkeys(SLOT_READERS, (R1, R2)),
    # side-record rows
    "seqrow_begin": (W1,),
    "seqrow_end": (W2,),
    "seqrow_add": (W1, W2),
    "mod_read_rows": (R1, R2),
}


def _cross_compile(tmp_path: Path) -> str:
    def unavailable(reason: str) -> None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must check the seqlock's aarch64 barriers: {reason}")
        pytest.skip(reason)

    if shutil.which(CC) is None:
        unavailable(f"{CC} is not installed: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross")
    out = tmp_path / "seqlock.s"
    cmd = [CC, "-O2", "-std=c11", "-S", "-I", str(ROOT / "kernels"), "-I", str(SOURCE.parent),
           "-I", sysconfig.get_paths()["include"], str(SOURCE), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        if "No such file or directory" in done.stderr and "#include <" in done.stderr:
            unavailable(f"{CC} has no aarch64 C library headers: apt-get install libc6-dev-arm64-cross "
                        f"({done.stderr.strip().splitlines()[-1]})")
        pytest.fail(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return out.read_text()


def _functions(asm: str) -> dict[str, list[str]]:
    """Each function's instructions (tabs made spaces), by name."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in asm.splitlines():
        label = re.match(r"^([A-Za-z_][\w.]*):", line)
        if label:
            current = bodies.setdefault(label.group(1), [])
        elif current is not None and line.startswith("\t") and not line.startswith("\t."):
            current.append(" ".join(line.split()))
    return bodies


def _reach(name: str, bodies: dict[str, list[str]]) -> list[str]:
    """The instructions of ``name`` and of every function of the file it calls, transitively."""
    seen, todo, out = set(), [name], []
    while todo:
        f = todo.pop()
        if f in seen or f not in bodies:
            continue
        seen.add(f)
        out += bodies[f]
        todo += [ins.split()[1] for ins in bodies[f] if ins.startswith(("bl ", "b ")) and len(ins.split()) == 2]
    return out


def _has(instructions: list[str], needed: str) -> bool:
    # "dmb ish" must not be met by "dmb ishld" or "dmb ishst": those order less than [W1] needs
    return any(ins == needed or ins.startswith(needed + " ") for ins in instructions)


def test_every_seqlock_writer_and_reader_has_its_aarch64_barriers(tmp_path):
    bodies = _functions(_cross_compile(tmp_path))
    missing_functions = sorted(set(NEEDS) - set(bodies))
    assert not missing_functions, f"not in the aarch64 assembly (renamed? update NEEDS): {missing_functions}"
    lost = [f"{name}: no {needed!r}" for name, needs in NEEDS.items() for needed in needs
            if not _has(_reach(name, bodies), needed)]
    assert not lost, "seqlock barriers missing on aarch64 (see dpb_seqlock.h): " + "; ".join(lost)


def test_the_barriers_are_not_everywhere(tmp_path):
    """The check can fail: a function outside the seqlock (the owner word's compare-and-swap,
    which needs no fence of its own) carries no [W1]/[R2] barrier."""
    bodies = _functions(_cross_compile(tmp_path))
    assert "mod_claim_slot" in bodies
    assert not _has(bodies["mod_claim_slot"], W1) and not _has(bodies["mod_claim_slot"], R2)

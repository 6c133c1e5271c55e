"""One source for the load formula and the GPU-direct slot write (dpboard/loads/formula.py): the CPU,
the CUDA C generated from it (kernels/dpboard_loads.h, run on the host by a C compiler and by nvcc
through kernels/loads.cu) and numba-cuda (the simulator, in its own interpreter) agree on the
reference cases; the header is current; the seqlock writers keep dpb_seqlock.h's order."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dpboard.loads import formula, formula_c
from dpboard.loads.counters import KVLoads, finish_raw, raw_has_errors
from tests.loads.formula_cases import CASES, GOLDEN, NUM_FIGURES, encode, run_cpu
from tests.loads.test_cuda_sources import find_nvcc
from tests.support.names import ROOT

KERNELS = ROOT / "kernels"

C_PROGRAM = r"""
/* The reference cases through the CUDA C of dpboard_loads.h on the host: figures, has_errors, then
   dpb_publish_raw on the case's slot and status words. With -DDPB_WITH_LOADS_CU (nvcc) the header
   comes in through kernels/loads.cu, as NVRTC compiles it; otherwise it is compiled as C. */
#ifdef DPB_WITH_LOADS_CU
#include "loads.cu"
#else
typedef long long i64;
#include "dpboard_loads.h"
#endif
#include <stdio.h>

#define N_HOST 7

static int read_all(i64 *v, int n) {
    for (int k = 0; k < n; k++)
        if (scanf("%lld", &v[k]) != 1) return 0;
    return 1;
}

int main(void) {
    int n;
    if (scanf("%d", &n) != 1) return 2;
    for (int c = 0; c < n; c++) {
        i64 raw[DPB_NUM_RAW], size[2], slot[DPB_DIRECT_SLOT_WORDS], status[DPB_DIRECT_STATUS_WORDS], host[N_HOST];
        if (!read_all(raw, DPB_NUM_RAW) || !read_all(size, 2) || !read_all(slot, DPB_DIRECT_SLOT_WORDS) ||
            !read_all(status, DPB_DIRECT_STATUS_WORDS) || !read_all(host, N_HOST))
            return 3;
        i64 f[6];
        dpb_load_figures(raw, size[0], size[1], &f[0], &f[1], &f[2], &f[3], &f[4], &f[5]);
        int bad = dpb_has_errors(raw);
        dpb_publish_raw(raw, size[0], size[1], slot, status, host[0], host[1], host[2], host[3], host[4], host[5],
                        host[6]);
        for (int k = 0; k < 6; k++) printf("%lld ", f[k]);
        printf("%d", bad);
        for (int k = 0; k < DPB_DIRECT_SLOT_WORDS; k++) printf(" %lld", slot[k]);
        for (int k = 0; k < DPB_DIRECT_STATUS_WORDS; k++) printf(" %lld", status[k]);
        printf("\n");
    }
    return 0;
}
"""


def _compile(compiler: str, tmp_path) -> str:
    if compiler == "nvcc":
        nvcc = find_nvcc()
        if nvcc is None:
            pytest.skip("nvcc is not installed here (the CUDA toolkit is needed for this check)")
        source = tmp_path / "formula.cu"
        cmd = [nvcc, "-std=c++17", "-DDPB_WITH_LOADS_CU", "-Werror", "all-warnings"]
    else:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler")
        source = tmp_path / "formula.c"
        cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]
    source.write_text(C_PROGRAM)
    binary = tmp_path / f"formula_{compiler}"
    result = subprocess.run([*cmd, "-I", str(KERNELS), "-o", str(binary), str(source)], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return str(binary)


def run_c(binary: str, cases) -> list[list[int]]:
    words = [len(cases), *(w for case in cases for w in encode(case))]
    out = subprocess.run([binary], input=" ".join(map(str, words)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [[int(x) for x in line.split()] for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def numba_results():
    """The numba-cuda path in the simulator (its own interpreter: the simulator is chosen before
    numba is imported)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "loads" / "cudasim" / "formula_proc.py")],
                         capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_the_cpu_figures_are_the_golden_ones():
    for case in CASES:
        if case.name in GOLDEN:
            assert tuple(finish_raw(np.array(case.raw, np.int64), case.num_pages, case.page_size)) == \
                GOLDEN[case.name], case.name
    assert raw_has_errors(np.array(CASES[-1].raw)) and not raw_has_errors(np.array(CASES[0].raw))


@pytest.mark.parametrize("compiler", ["nvcc", "cc"])
def test_three_paths_agree_on_the_reference_cases(compiler, tmp_path, numba_results):
    """CPU == CUDA C (compiled for the host by ``compiler``) == numba-cuda (simulator), word for word."""
    cpu = [run_cpu(case) for case in CASES]
    c = run_c(_compile(compiler, tmp_path), CASES)
    for case, want, got_c, got_numba in zip(CASES, cpu, c, numba_results, strict=True):
        assert got_c == want, f"CUDA C ({compiler}) differs from the CPU on {case.name!r}"
        assert got_numba == want, f"numba-cuda differs from the CPU on {case.name!r}"
        if case.name in GOLDEN:
            assert tuple(want[:NUM_FIGURES]) == GOLDEN[case.name]


def test_numba_types_the_formula_in_nopython_mode():
    """The simulator runs formula.py as Python; Numba's nopython typing (shared by numba-cuda, here on
    the CPU target, no GPU needed) must accept it too, with int64 results, and agree."""
    numba = pytest.importorskip("numba")
    from dpboard.loads.cuda import bind_formula
    from dpboard.snapshot import DIRECT_SLOT_WORDS, NUM_RAW

    compiled = bind_formula(numba.njit, {name: numba.njit(getattr(formula, name)) for name in formula.PRIMITIVES})
    for case in CASES:
        words = np.array(encode(case), np.int64)
        raw, slot = words[:NUM_RAW], words[NUM_RAW + 2 : NUM_RAW + 2 + DIRECT_SLOT_WORDS].copy()
        status = words[NUM_RAW + 2 + DIRECT_SLOT_WORDS : -len(case.host)].copy()
        n, size = np.int64(case.num_pages), np.int64(case.page_size)
        figures = compiled["load_figures"](raw, n, size)
        bad = compiled["has_errors"](raw)
        compiled["publish_raw"](raw, n, size, slot, status, *(np.int64(v) for v in case.host))
        assert [*figures, int(bad), *slot.tolist(), *status.tolist()] == run_cpu(case), case.name
    assert str(compiled["load_figures"].nopython_signatures[0].return_type) == "UniTuple(int64 x 6)"
    assert str(compiled["write_slot"].nopython_signatures[0].return_type) == "int64"


def test_what_the_reference_cases_publish():
    """The words themselves, on three cases: a publish, a repair of an odd slot, bad tables."""
    from dpboard.snapshot import DIRECT_STATUS_INDEX as S
    from dpboard.snapshot import FIELD_INDEX as F
    from tests.loads.formula_cases import W0, slot_before, status_before

    by_name = {case.name: case for case in CASES}
    typical = run_cpu(by_name["typical"])
    slot, status = typical[NUM_FIGURES + 1 : -len(status_before())], typical[-len(status_before()):]
    assert slot[0] == 2 and slot[W0 + F["publish_seq"]] == 1 and slot[16] == 0
    assert slot[W0 + 1 : W0 + 7] == list(GOLDEN["typical"])
    assert slot[14:16] == slot_before(by_name["typical"])[14:16]  # owner and reserved words untouched
    assert (status[S["launch_id"]], status[S["published"]], status[S["publish_seq"]]) == (9, 1, 1)

    odd = run_cpu(by_name["slot left odd by a dead writer"])[NUM_FIGURES + 1 :]
    assert odd[0] == 44 and odd[W0 + F["publish_seq"]] == 10  # 41 -> 42 (stepped past), 43, 44

    bad_case = by_name["bad request states"]
    bad = run_cpu(bad_case)
    assert bad[NUM_FIGURES] == 1
    assert bad[NUM_FIGURES + 1 : -len(status_before())] == slot_before(bad_case)  # nothing published
    status = bad[-len(status_before()):]
    assert (status[S["published"]], status[S["bad_req_states"]], status[S["launch_id"]]) == (0, 3, 9)


def test_the_board_writer_publishes_the_fields_the_gpu_writes(board_name):
    """The CPU's slot write (BoardWriter, dpb_seqlock.h) and formula.write_slot leave the same words
    in a fresh slot, but for the clocks, which the CPU writer stamps itself."""
    from dpboard import Board, LoadSnapshot
    from dpboard.publish.gpu_direct import slot_view
    from dpboard.snapshot import DIRECT_SLOT_WORDS, FIELD_INDEX, FIELDS_OFFSET

    good = [case for case in CASES  # what a board accepts: good tables, no negative figure
            if not raw_has_errors(case.raw) and min(finish_raw(case.raw, case.num_pages, case.page_size)) >= 0]
    clocks = [FIELDS_OFFSET // 8 + FIELD_INDEX[n] for n in ("timestamp_ns", "monotonic_ns")]
    with Board.create(board_name, n_slots=len(good), node_id=2) as board:
        for rank, case in enumerate(good):
            writer = board.writer(rank)
            loads = finish_raw(case.raw, case.num_pages, case.page_size)
            writer.publish(LoadSnapshot(dp_rank=rank, **loads._asdict(), num_received_reqs=case.host[1]))
            cpu = slot_view(writer.slot_address)[:DIRECT_SLOT_WORDS].tolist()
            gpu = [0] * DIRECT_SLOT_WORDS
            gpu[14:16] = cpu[14:16]  # the owner and reserved words: the board's, never a kernel's
            formula.write_slot(gpu, list(case.raw), case.num_pages, case.page_size, rank, case.host[1], 0, 0,
                               os.getpid(), 2)
            for k in clocks:
                cpu[k] = gpu[k] = 0
            assert cpu == gpu, case.name


def test_load_figures_returns_kvloads_fields_in_order():
    tree = ast.parse(inspect.getsource(formula))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_figures")
    assert formula_c.Function.result_names(fn) == KVLoads._fields


def _gen_layout():
    spec = importlib.util.spec_from_file_location("_gen_layout_for_test", ROOT / "tools" / "gen_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_loads_header_is_current_and_follows_formula_py(tmp_path):
    gen = _gen_layout()
    assert (KERNELS / "dpboard_loads.h").read_text() == gen.render_loads()
    changed = gen.render_loads(gen.FORMULA_PATH.read_text().replace("max(0, num_total_tokens", "max(1, num_total_tokens"))
    assert "dpb_max(1, num_total_tokens" in changed
    stale = tmp_path / "dpboard_loads.h"
    stale.write_text(changed)
    cmd = [sys.executable, str(ROOT / "tools" / "gen_layout.py"), "--loads-path", str(stale)]
    out = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "dpboard_loads.h is stale" in out.stderr
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert stale.read_text() == gen.render_loads()


def _body(text: str, name: str) -> str:
    """The body of C function ``name`` in ``text``."""
    start = text.index("{", re.search(rf"\b{name}\(", text).start())
    return text[start : text.index("\n}", start)]


def _marked(body: str, comment: str = "/*") -> list[tuple[str, str]]:
    """(mark, code) of each line of ``body`` that carries a [W*] mark in a comment, in order."""
    found = []
    for line in body.splitlines():
        code, _, note = line.partition(comment)
        mark = re.search(r"\[W[0-9D]\]", note)
        if mark:
            found.append((mark.group(0), code.strip()))
    return found


def test_every_seqlock_writer_keeps_dpb_seqlock_h_order():
    """[W0] the odd store, [W1] a fence, [WD] the data, [W2] the even store as a release: in
    dpb_seqlock.h's CPU writer, its GPU twin kernels/dpb_seqlock_gpu.h and numba-cuda's primitives;
    and formula.write_slot stores every word between the open and the close."""
    cpu = (ROOT / "dpboard" / "board" / "dpb_seqlock.h").read_text()
    opened, closed = _marked(_body(cpu, "dpb_seq_open")), _marked(_body(cpu, "dpb_seq_close"))
    assert [m for m, _ in opened] == ["[W0]", "[W1]"] and "store" in opened[0][1] and "fence" in opened[1][1]
    assert [m for m, _ in closed] == ["[W2]"] and "store" in closed[0][1] and "RELEASE" in closed[0][1]

    gpu = (KERNELS / "dpb_seqlock_gpu.h").read_text()
    assert _marked(_body(gpu, "dpb_gpu_seq_open")) == [
        ("[W0]", "slot[DPB_SEQ_OFFSET / 8] = odd;"), ("[W1]", "dpb_gpu_fence_system();")]
    assert _marked(_body(gpu, "dpb_gpu_seq_close")) == [
        ("[W2]", "dpb_gpu_fence_system();"), ("[W2]", "slot[DPB_SEQ_OFFSET / 8] = odd + 1;")]
    assert "__threadfence_system();" in _body(gpu, "dpb_gpu_fence_system")

    from dpboard.loads import cuda as kc

    numba = inspect.getsource(kc._seqlock_primitives)
    seq_open = numba[numba.index("def seq_open"): numba.index("def seq_close")]
    seq_close = numba[numba.index("def seq_close"):]
    assert _marked(seq_open, "#") == [("[W0]", "cuda.atomic.exch(slot, _SEQ_WORD, odd)"),
                                      ("[W1]", "cuda.threadfence_system()")]
    assert _marked(seq_close, "#") == [("[W2]", "cuda.threadfence_system()"),
                                       ("[W2]", "cuda.atomic.exch(slot, _SEQ_WORD, odd + 1)")]

    tree = ast.parse(textwrap.dedent(inspect.getsource(formula.write_slot)))
    body = tree.body[0].body
    calls = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    assert [body[i].value.func.id for i in calls] == ["seq_open", "seq_close"]
    stores = [i for i, s in enumerate(body) if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Subscript)]
    assert stores and calls[0] < min(stores) and max(stores) < calls[1]


SUBSET_MODULE = '''
FUNCTIONS = ("f",)
PRIMITIVES = ()


def f(a: int, b: int, c: int) -> {result}:
{body}
'''


def _translate(body: str, result: str = "int") -> str:
    source = SUBSET_MODULE.format(result=result, body=textwrap.indent(textwrap.dedent(body), "    "))
    return formula_c.render(source, set())


def test_the_translation_keeps_python_meaning_under_c_precedence():
    assert "return (a & 1) == 0;" in _translate("return a & 1 == 0", "bool")  # Python: (a & 1) == 0
    assert "return a - (b - c);" in _translate("return a - (b - c)")
    assert "return a - b - c;" in _translate("return (a - b) - c")
    assert "return (a + b) * c;" in _translate("return (a + b) * c")
    assert "return a || b && c;" in _translate("return a or (b and c)", "bool")
    assert "return (a || b) && c;" in _translate("return (a or b) and c", "bool")
    assert "return dpb_max(0, -a);" in _translate("return max(0, -a)")


@pytest.mark.parametrize(("body", "what"), [
    ("while a:\n    a -= 1\nreturn a", "the statement"),
    ("return a // b", "// in a function"),
    ("return d", "the name d"),
    ("if a:\n    d = 1\nreturn b", "d first assigned inside an if"),
    ("return 1.5", "the expression"),
    ("return g(a)", "the call of g"),
])
def test_python_outside_the_subset_is_refused_naming_the_line(body, what):
    with pytest.raises(formula_c.NotInSubset, match=rf"formula.py:\d+: {re.escape(what)}"):
        _translate(body)

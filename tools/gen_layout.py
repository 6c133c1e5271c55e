"""Generate ``kernels/dpboard_layout.h``, the layout of ``dpboard/snapshot.py`` as a C header.

It also writes ``kernels/dpboard_loads.h``: the load formula and the GPU-direct publish of
``dpboard/loads/formula.py`` in CUDA C (translated by ``dpboard/loads/formula_c.py``), so that the
CPU, the numba-cuda and the CUDA C paths share one source; ``--check`` covers both headers.

The header is committed, so that building the extension needs no Python step:
``python tools/gen_layout.py`` rewrites it after a layout change (``make layout`` does the same and
rebuilds), and ``python tools/gen_layout.py --check`` (run by the test suite) fails when the
committed header no longer matches snapshot.py. The header holds only ``#define`` lines, which NVRTC
(no standard library) reads as well as a C compiler.

snapshot.py is loaded from its file, not imported as ``dpboard.snapshot``: importing the package
checks the compiled extension against the layout, which is exactly what is stale at this point.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER_PATH = ROOT / "kernels" / "dpboard_layout.h"
LOADS_HEADER_PATH = ROOT / "kernels" / "dpboard_loads.h"
FORMULA_PATH = ROOT / "dpboard" / "loads" / "formula.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-like machinery (NamedTuple) looks the module up
    spec.loader.exec_module(module)
    return module


def _load_snapshot():
    return _load("_dpboard_snapshot", ROOT / "dpboard" / "snapshot.py")


s = _load_snapshot()


def _macro(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def render() -> str:
    """The text of ``dpboard_layout.h`` for the layout in ``dpboard.snapshot``."""
    lines = [
        "/* dpboard's board layout and shared codes, generated from dpboard/snapshot.py by",
        " * tools/gen_layout.py: do not edit; change snapshot.py and regenerate (make layout). */",
        "#ifndef DPBOARD_LAYOUT_H",
        "#define DPBOARD_LAYOUT_H",
        "",
        f"#define DPB_LAYOUT_VERSION {s.LAYOUT_VERSION}",
        f"#define DPB_HEADER_SIZE {s.HEADER_SIZE}",
        f"#define DPB_SLOT_SIZE {s.SLOT_SIZE}",
        f"#define DPB_SEQ_OFFSET {s.SEQ_OFFSET}",
        f"#define DPB_FIELDS_OFFSET {s.FIELDS_OFFSET}",
        f"#define DPB_OWNER_OFFSET {s.OWNER_OFFSET}",
        f"#define DPB_OWNER_PID_BITS {s.OWNER_PID_BITS}",
        f"#define DPB_RESERVED_OFFSET {s.RESERVED_OFFSET}",
        f"#define DPB_DETAIL_OFFSET {s.DETAIL_OFFSET}",
        f"#define DPB_DETAIL_SIZE {s.DETAIL_SIZE}",
        f"#define DPB_DETAIL_WORDS {s.DETAIL_WORDS}",
        f"#define DPB_DETAIL_PRESENT {s.DETAIL_PRESENT}",
        f"#define DPB_DETAILED_RECORD_SIZE {s.DETAILED_DTYPE.itemsize}",
        f"#define DPB_DIRECT_SLOT_WORDS {s.DIRECT_SLOT_WORDS}",
        f"#define DPB_RECORD_SIZE {s.RECORD_SIZE}",
        f"#define DPB_RECORD_STATUS_OFFSET {s.RECORD_STATUS_OFFSET}",
        "",
        "/* LoadSnapshot fields: int64 each, in this order after the sequence word. */",
        f"#define DPB_NUM_FIELDS {s.NUM_FIELDS}",
        *(f"#define DPB_F_{_macro(name)} {i}" for i, name in enumerate(s.FIELD_NAMES)),
        f"#define DPB_F_LOAD_FIRST {s.FIELD_INDEX[s.LOAD_FIELDS[0]]}",
        f"#define DPB_F_LOAD_LAST {s.FIELD_INDEX[s.LOAD_FIELDS[-1]]}",
        "#define DPB_FIELD_NAMES_INIT " + ", ".join(f'"{name}"' for name in s.FIELD_NAMES),
        "",
        "/* SlotStatus */",
        *(f"#define DPB_STATUS_{st.name} {st.value}" for st in s.SlotStatus),
        f"#define DPB_NUM_STATUSES {len(s.SlotStatus)}",
        "",
        "/* ReqState and PageState codes of the load kernels' tables */",
        *(f"#define DPB_REQ_{st.name} {st.value}" for st in s.ReqState),
        f"#define DPB_NUM_REQ_STATES {len(s.ReqState)}",
        *(f"#define DPB_PAGE_{st.name} {st.value}" for st in s.PageState),
        f"#define DPB_NUM_PAGE_STATES {len(s.PageState)}",
        f"#define DPB_MAX_SEQLEN {s.MAX_SEQLEN}LL",
        "",
        "/* The raw counters every load backend produces */",
        *(f"#define DPB_RAW_{_macro(name)} {i}" for i, name in enumerate(s.RAW_FIELDS)),
        f"#define DPB_NUM_RAW {s.NUM_RAW}",
        "",
        "/* GPU-direct status words */",
        *(f"#define DPB_DIRECT_{_macro(name)} {i}" for i, name in enumerate(s.DIRECT_STATUS_FIELDS)),
        f"#define DPB_DIRECT_STATUS_WORDS {s.DIRECT_STATUS_WORDS}",
        "",
        "#endif /* DPBOARD_LAYOUT_H */",
    ]
    return "\n".join(lines) + "\n"


def render_loads(formula_source: str | None = None) -> str:
    """The text of ``dpboard_loads.h``: formula.py in CUDA C, naming only the layout header's macros."""
    formula_c = _load("_dpboard_formula_c", ROOT / "dpboard" / "loads" / "formula_c.py")
    source = FORMULA_PATH.read_text() if formula_source is None else formula_source
    return formula_c.render(source, formula_c.defined_macros(render()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/gen_layout.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when a committed header is stale")
    p.add_argument("--path", type=Path, default=HEADER_PATH, help=f"default {HEADER_PATH}")
    p.add_argument("--loads-path", type=Path, default=LOADS_HEADER_PATH, help=f"default {LOADS_HEADER_PATH}")
    args = p.parse_args(argv)
    stale = 0
    for path, text in ((args.path, render()), (args.loads_path, render_loads())):
        current = path.read_text() if path.exists() else ""
        if args.check:
            if current != text:
                print(f"{path} is stale: run `make layout` (regenerates it and "
                      f"rebuilds the extension)", file=sys.stderr)
                stale = 1
        elif current != text:
            path.write_text(text)
            print(f"wrote {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())

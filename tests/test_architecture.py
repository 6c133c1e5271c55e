"""The shape of the package: imports go down the data flow and never in a circle, and the layout
facts have one source.

The layers, from the leaves up (docs/ARCHITECTURE.md draws the same picture). A module may import
its own layer and the layers below it; layers on one row are independent of each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.names import ROOT

PACKAGE = ROOT / "dpboard"

LAYERS: list[set[str]] = [
    {"errors", "snapshot", "stopping", "options", "processes", "lazy"},  # the leaf contract and shared plumbing
    {"methods"},  # the method table, which the controller and the views read
    {"ownership", "guard", "steplog"},  # files in shared directories, single-owner locks, endpoints | connection
    # bounds | the step log (format, writer, reader, summary) the engines' step recorders write
    {"board", "loads"},  # the segment and its seqlock | tables -> counters
    {"publish"},  # counters -> the rank's slot
    {"multinode"},  # other nodes' boards -> node0's board (a side path into the board)
    {"controller", "views"},  # board -> budget -> dispatcher | board -> what people read
    {"integrations"},  # engines at the edge: they embed publish, controller and views
    {"sim", "demo", "bench"},  # whole-system runs
    {"cli"},  # the command table
    {"__main__"},  # `python -m dpboard` runs the command table
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
PACKAGE_FACADE = "__init__"  # dpboard/__init__.py re-exports the public API (lazily for the kernels)


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every dpboard module this file imports, at the top or inside a function (lazy imports count)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "dpboard")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "dpboard":
                continue
            for alias in node.names:
                # `from dpboard.loads import cuda` imports the module dpboard.loads.cuda
                candidate = f"{mod}.{alias.name}"
                found.add(candidate if _is_module(candidate, root) else mod)
    return {m for m in found if m != here}


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    # a Python module, a package, or a C extension (built from path.c)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or path.with_suffix(".c").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE_FACADE


def test_every_stage_has_a_layer():
    stages = {stage(m) for m in graph()} - {PACKAGE_FACADE}
    assert stages <= set(LEVEL), f"add these to LAYERS (and docs/ARCHITECTURE.md): {sorted(stages - set(LEVEL))}"


def test_imports_only_go_down_the_flow():
    upward = []
    for module, deps in graph().items():
        src = stage(module)
        if src == PACKAGE_FACADE:
            continue
        for dep in deps:
            dst = stage(dep)
            if dst == PACKAGE_FACADE:
                # `import dpboard` for __version__ or the public names: allowed from the views and above
                if LEVEL[src] < LEVEL["controller"]:
                    upward.append(f"{module} -> {dep} (the package facade)")
                continue
            if dst != src and (LEVEL[dst] > LEVEL[src] or (LEVEL[dst] == LEVEL[src])):
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports against the flow (or between independent stages):\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    g = {m: {d for d in deps if d in graph_keys} for graph_keys in [set(graph())] for m, deps in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    # The package facade imports its stages lazily on attribute access and they may import it back.
    cycles = [c for c in cycles if "dpboard" not in c]
    assert not cycles, f"import cycles: {cycles}"


def test_the_walker_sees_relative_lazy_and_module_imports(tmp_path):
    for folder in ("dpboard", "dpboard/board", "dpboard/views"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "dpboard/views/top.py").write_text("")
    (tmp_path / "dpboard/board/a.py").write_text("def f():\n    from dpboard.views import top\n")
    (tmp_path / "dpboard/board/b.py").write_text("from . import a\nfrom dpboard.views import thing\n")
    assert imports_of(tmp_path / "dpboard/board/a.py", tmp_path) == {"dpboard.views.top"}
    assert imports_of(tmp_path / "dpboard/board/b.py", tmp_path) == {"dpboard.board.a", "dpboard.views"}


def test_the_generated_layout_header_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_layout.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_layout_change_reaches_the_header(tmp_path):
    """Regenerating after an offset change rewrites the C and CUDA view of it; --check flags it."""
    header = tmp_path / "dpboard_layout.h"
    gen = [sys.executable, str(ROOT / "tools" / "gen_layout.py"), "--path", str(header)]
    assert subprocess.run(gen, capture_output=True, timeout=60).returncode == 0
    text = header.read_text()
    assert "#define DPB_OWNER_OFFSET 112" in text
    header.write_text(text.replace("#define DPB_OWNER_OFFSET 112", "#define DPB_OWNER_OFFSET 120"))
    stale = subprocess.run([*gen, "--check"], capture_output=True, text=True, timeout=60)
    assert stale.returncode == 1 and "is stale" in stale.stderr
    assert subprocess.run(gen, capture_output=True, timeout=60).returncode == 0
    assert header.read_text() == text


def test_the_extension_refuses_another_layout(monkeypatch):
    """An extension built for another layout is an import error naming both values (the check that
    runs when dpboard.board is imported, here against a snapshot.py that moved a field)."""
    from dpboard import snapshot
    from dpboard.board import seqlock

    seqlock._check_compiled_layout()  # the built extension matches the source
    monkeypatch.setattr(snapshot, "OWNER_OFFSET", snapshot.OWNER_OFFSET + 8)
    with pytest.raises(ImportError, match="OWNER_OFFSET is 112 in the extension but 120 in snapshot.py.*make layout"):
        seqlock._check_compiled_layout()


def test_read_only_commands_import_no_numba():
    code = (
        "import sys; import dpboard.views.inspect, dpboard.views.top, dpboard.views.serve, dpboard.cli; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy', 'llvmlite')); "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

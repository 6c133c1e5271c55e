"""``dpboard/loads/formula.py`` in CUDA C: the text of ``kernels/dpboard_loads.h``.

``tools/gen_layout.py`` calls ``render`` with formula.py's source and the macros of
``kernels/dpboard_layout.h``; the header is committed beside it and checked current by the test
suite. The translation reads the source (``ast``), never imports it, and knows only the subset of
Python that formula.py's docstring describes: anything else is an error naming the line, so a
change to formula.py that the C could not follow fails at generation, not on a GPU.

- Constants: a module-level name is replaced by its definition, in which ``dpboard.snapshot``'s
  names become their ``DPB_*`` macros (``RAW_INDEX["running"]`` is ``DPB_RAW_RUNNING``,
  ``FIELD_INDEX["dp_rank"]`` ``DPB_F_DP_RANK``, ``DIRECT_STATUS_INDEX["published"]``
  ``DPB_DIRECT_PUBLISHED``, ``SEQ_OFFSET`` ``DPB_SEQ_OFFSET``); each must exist in the layout header.
- Functions: ``name`` becomes ``dpb_name``; arguments ``int`` are ``i64``, ``Counters`` ``const i64 *``
  and ``Words`` ``volatile i64 *`` (every store to a slot or status word is a volatile 8-byte store);
  a ``bool`` result is an ``int``, a tuple result comes back through ``NAME_out`` pointers. A
  primitive ``p`` (formula.PRIMITIVES) is ``dpb_gpu_p`` of ``kernels/dpb_seqlock_gpu.h``.
- Expressions keep their meaning under C's precedences (parentheses are written where C needs
  them); ``max(a, b)`` is ``dpb_max``; ``//`` is allowed in constants only (non-negative there).

No import of dpboard here: the generator loads this file by path, like snapshot.py.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize

TYPES = {"int": "i64", "Counters": "const i64 *", "Words": "volatile i64 *"}
RESULTS = {"int": "i64", "bool": "int", "None": "void"}
INDEX_MACROS = {"RAW_INDEX": "DPB_RAW_", "FIELD_INDEX": "DPB_F_", "DIRECT_STATUS_INDEX": "DPB_DIRECT_"}
BINOPS: dict[type, tuple[str, int]] = {
    ast.Mult: ("*", 13), ast.FloorDiv: ("/", 13), ast.Add: ("+", 12), ast.Sub: ("-", 12),
    ast.BitAnd: ("&", 8), ast.BitXor: ("^", 7), ast.BitOr: ("|", 6),
}
COMPARES: dict[type, tuple[str, int]] = {
    ast.Lt: ("<", 10), ast.LtE: ("<=", 10), ast.Gt: (">", 10), ast.GtE: (">=", 10), ast.Eq: ("==", 9),
    ast.NotEq: ("!=", 9),
}
BOOLOPS: dict[type, tuple[str, int]] = {ast.And: ("&&", 5), ast.Or: ("||", 4)}
ATOM = 17
WIDTH = 116  # the generated lines' width (C, not Python: a line is broken after a comma or an operator)


class NotInSubset(ValueError):
    """formula.py uses Python that the C translation does not know."""


def _fail(node: ast.AST, what: str) -> NotInSubset:
    return NotInSubset(f"formula.py:{getattr(node, 'lineno', '?')}: {what} is outside the subset that "
                       f"dpboard/loads/formula_c.py translates to C")


def _macro(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.upper())


class Module:
    """formula.py's source, read: its constants, functions and the layout macros they may name."""

    def __init__(self, source: str, macros: set[str]) -> None:
        self.tree = ast.parse(source)
        self.macros = macros
        self.comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                self.comments[tok.start[0]] = tok.string.lstrip("#").strip()
        self.snapshot_names: set[str] = set()
        self.constants: dict[str, ast.expr] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        lists: dict[str, tuple[str, ...]] = {}
        for node in self.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "dpboard.snapshot":
                self.snapshot_names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if name in ("FUNCTIONS", "PRIMITIVES"):
                    lists[name] = ast.literal_eval(node.value)
                else:
                    self.constants[name] = node.value
            elif isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
        self.order: tuple[str, ...] = lists.get("FUNCTIONS", ())
        self.primitives: tuple[str, ...] = lists.get("PRIMITIVES", ())
        for name in (*self.order, *self.primitives):
            if name not in self.functions:
                raise NotInSubset(f"formula.py lists {name} but defines no such function")

    def macro(self, node: ast.AST, name: str) -> str:
        if name not in self.macros:
            raise _fail(node, f"{name} (not a macro of kernels/dpboard_layout.h)")
        return name

    # -- expressions: (C text, C precedence) ------------------------------------------------------

    def expr(self, node: ast.expr, fn: Function | None) -> tuple[str, int]:
        if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            value = int(node.value)
            return (f"{value}LL" if abs(value) >= 2**31 else str(value)), ATOM
        if isinstance(node, ast.Name):
            if fn is not None and node.id in fn.locals:
                return node.id, ATOM
            if node.id in self.constants:
                return self.expr(self.constants[node.id], None)
            if node.id in self.snapshot_names:
                return self.macro(node, f"DPB_{_macro(node.id)}"), ATOM
            raise _fail(node, f"the name {node.id}")
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Name) and node.value.id in INDEX_MACROS and fn is None:
                key = node.slice
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise _fail(node, f"{node.value.id}[...] with a key that is not a string")
                return self.macro(node, INDEX_MACROS[node.value.id] + _macro(key.value)), ATOM
            if fn is None or not (isinstance(node.value, ast.Name) and node.value.id in fn.arrays):
                raise _fail(node, "an index into something that is not an array argument")
            return f"{node.value.id}[{self.expr(node.slice, fn)[0]}]", 16
        if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
            op, prec = BINOPS[type(node.op)]
            if op == "/" and fn is not None:
                raise _fail(node, "// in a function (C's / rounds toward zero)")
            left = self.operand(node.left, fn, prec, right=False)
            right = self.operand(node.right, fn, prec, right=True)
            return f"{left} {op} {right}", prec
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARES:
            op, prec = COMPARES[type(node.ops[0])]
            left = self.operand(node.left, fn, prec, right=False)
            right = self.operand(node.comparators[0], fn, prec, right=True)
            return f"{left} {op} {right}", prec
        if isinstance(node, ast.BoolOp) and type(node.op) in BOOLOPS:
            op, prec = BOOLOPS[type(node.op)]
            return f" {op} ".join(self.operand(v, fn, prec, right=False) for v in node.values), prec
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            return ("-" if isinstance(node.op, ast.USub) else "!") + self.operand(node.operand, fn, 15, True), 15
        if isinstance(node, ast.Call) and fn is not None:
            return self.call(node, fn, ()), 16
        raise _fail(node, f"the expression {ast.unparse(node)!r}")

    def operand(self, node: ast.expr, fn: Function | None, prec: int, right: bool) -> str:
        text, inner = self.expr(node, fn)
        return f"({text})" if inner < prec or (right and inner == prec) else text

    def call(self, node: ast.Call, fn: Function, outs: tuple[str, ...]) -> str:
        if not isinstance(node.func, ast.Name) or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise _fail(node, f"the call {ast.unparse(node)!r}")
        name = node.func.id
        args = [a.id if isinstance(a, ast.Name) and a.id in fn.arrays else self.expr(a, fn)[0] for a in node.args]
        if name == "max" and len(args) == 2 and not outs:
            return f"dpb_max({', '.join(args)})"
        if name in self.primitives and not outs:
            return f"dpb_gpu_{name}({', '.join(args)})"
        if name in self.order:
            callee = self.functions[name]
            tuple_result = Function.result_names(callee) is not None
            if tuple_result != bool(outs):
                raise _fail(node, f"{name}'s result {'unpacked' if outs else 'used'} this way")
            return f"dpb_{name}({', '.join([*args, *(f'&{o}' for o in outs)])})"
        raise _fail(node, f"the call of {name}")

    # -- the header --------------------------------------------------------------------------------

    def render(self) -> str:
        lines = [
            "/* dpboard's load formula and GPU-direct publish, generated from dpboard/loads/formula.py by",
            " * tools/gen_layout.py: do not edit; change formula.py and regenerate (make layout).",
            " * The includer defines i64 (long long) first, as kernels/loads.cu does. */",
            "#ifndef DPBOARD_LOADS_H",
            "#define DPBOARD_LOADS_H",
            "",
            '#include "dpboard_layout.h"',
            '#include "dpb_seqlock_gpu.h"',
            "",
            "DPB_FN i64 dpb_max(i64 a, i64 b) { return a > b ? a : b; }",
        ]
        for name in self.order:
            lines += ["", *Function(self, self.functions[name]).render()]
        lines += ["", "#endif /* DPBOARD_LOADS_H */"]
        return "\n".join(lines) + "\n"


class Function:
    """One function of formula.py in C."""

    def __init__(self, module: Module, node: ast.FunctionDef) -> None:
        self.m = module
        self.node = node
        self.locals: set[str] = set()
        self.arrays: set[str] = set()
        self.params: list[str] = []
        args = node.args
        if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults:
            raise _fail(node, f"{node.name}'s signature (plain positional arguments only)")
        for a in args.args:
            kind = ast.unparse(a.annotation) if a.annotation is not None else ""
            if kind not in TYPES:
                raise _fail(a, f"argument {a.arg}: {kind or 'no'} annotation (int, Counters or Words)")
            ctype = TYPES[kind]
            self.params.append(f"{ctype}{a.arg}" if ctype.endswith("*") else f"{ctype} {a.arg}")
            (self.arrays if ctype.endswith("*") else self.locals).add(a.arg)
        self.outs = self.result_names(node)
        result = ast.unparse(node.returns) if node.returns is not None else ""
        if self.outs is not None:
            self.ctype = "void"
            self.params += [f"i64 *{o}_out" for o in self.outs]
        elif result in RESULTS:
            self.ctype = RESULTS[result]
        else:
            raise _fail(node, f"{node.name}'s result annotation {result or '(none)'}")

    @staticmethod
    def result_names(node: ast.FunctionDef) -> tuple[str, ...] | None:
        """The names of a tuple result (its one return is the last statement), or None."""
        if node.returns is None or not ast.unparse(node.returns).startswith("tuple["):
            return None
        last = node.body[-1]
        if not (isinstance(last, ast.Return) and isinstance(last.value, ast.Tuple)
                and all(isinstance(e, ast.Name) for e in last.value.elts)):
            raise _fail(node, f"{node.name}: a tuple result that is not one last `return name, name, ...`")
        return tuple(e.id for e in last.value.elts)  # type: ignore[attr-defined]

    def render(self) -> list[str]:
        doc = ast.get_docstring(self.node)
        lines = []
        if doc:
            lines += textwrap.wrap(" ".join(doc.split()), WIDTH - 3, initial_indent="/* ", subsequent_indent=" * ")
            lines[-1] += " */"
        lines.append(f"DPB_FN {self.ctype} dpb_{self.node.name}({', '.join(self.params)}) {{")
        body = self.node.body[1:] if doc else self.node.body
        lines += self.block(body, 1, top=True)
        lines.append("}")
        return [wrapped for line in lines for wrapped in wrap(line)]

    def comment(self, line: int) -> str:
        return f"  // {self.m.comments[line]}" if line in self.m.comments else ""

    def block(self, body: list[ast.stmt], depth: int, top: bool) -> list[str]:
        """The C of ``body``, indented ``depth`` levels; a statement's comment goes on its first line."""
        out: list[str] = []
        for node in body:
            note = "" if isinstance(node, ast.If) else next(
                (self.comment(n) for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                 if n in self.m.comments), "")
            lines = self.statement(node, depth, top)
            out += [lines[0] + note, *lines[1:]]
        return out

    def statement(self, node: ast.stmt, depth: int, top: bool) -> list[str]:
        m = self.m
        pad = "    " * depth
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Tuple):
                names = [e.id for e in target.elts if isinstance(e, ast.Name)]
                if len(names) != len(target.elts) or not isinstance(node.value, ast.Call) or not top:
                    raise _fail(node, "a tuple assignment that is not `name, ... = f(...)` at the top level")
                if any(n in self.locals for n in names):
                    raise _fail(node, "a tuple assignment to a name assigned before")
                self.locals.update(names)
                return [f"{pad}i64 {', '.join(names)};", f"{pad}{m.call(node.value, self, tuple(names))};"]
            value = m.expr(node.value, self)[0]
            if isinstance(target, ast.Name):
                if target.id in self.locals:
                    return [f"{pad}{target.id} = {value};"]
                if not top:
                    raise _fail(node, f"{target.id} first assigned inside an if (C would scope it there)")
                self.locals.add(target.id)
                return [f"{pad}i64 {target.id} = {value};"]
            if isinstance(target, ast.Subscript):
                return [f"{pad}{m.expr(target, self)[0]} = {value};"]
        if isinstance(node, ast.AugAssign) and type(node.op) in BINOPS and not isinstance(node.op, ast.FloorDiv):
            if isinstance(node.target, ast.Name) and node.target.id not in self.locals:
                raise _fail(node, f"{node.target.id} updated before it is assigned")
            target = m.expr(node.target, self)[0]  # type: ignore[arg-type]
            return [f"{pad}{target} {BINOPS[type(node.op)][0]}= {m.expr(node.value, self)[0]};"]
        if isinstance(node, ast.If):
            lines = [f"{pad}if ({m.expr(node.test, self)[0]}) {{{self.comment(node.lineno)}"]
            lines += self.block(node.body, depth + 1, top=False)
            if node.orelse:
                lines.append(f"{pad}}} else {{")
                lines += self.block(node.orelse, depth + 1, top=False)
            return [*lines, f"{pad}}}"]
        if isinstance(node, ast.Return):
            if self.outs is not None:
                if node is not self.node.body[-1]:
                    raise _fail(node, "a return before the end of a function with a tuple result")
                return [f"{pad}*{o}_out = {o};" for o in self.outs]
            if node.value is None:
                if self.ctype != "void":
                    raise _fail(node, "a bare return in a function with a result")
                return [f"{pad}return;"]
            return [f"{pad}return {m.expr(node.value, self)[0]};"]
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            return [f"{pad}{m.call(node.value, self, ())};"]
        raise _fail(node, f"the statement {ast.unparse(node).splitlines()[0]!r}")


def wrap(line: str) -> list[str]:
    """A C line past WIDTH broken after commas, its comment kept whole on the last piece;
    continuation lines indented two levels deeper."""
    if len(line) <= WIDTH or line.lstrip().startswith(("/*", " *")):
        return [line]
    code, sep, note = line.partition("  // ")
    indent = " " * (len(code) - len(code.lstrip()) + 8)
    pieces = [""]
    for k, part in enumerate(code.split(", ")):
        word = part if k == 0 else ", " + part
        if pieces[-1] and len(pieces[-1]) + len(word.rstrip()) > WIDTH:
            pieces[-1] += ","
            pieces.append(indent + part)
        else:
            pieces[-1] += word
    if sep:
        pieces[-1] += sep + note
    return pieces


def render(source: str, macros: set[str]) -> str:
    """The text of kernels/dpboard_loads.h for formula.py's ``source``; ``macros`` are the names the
    layout header defines (a constant that names another is an error)."""
    return Module(source, macros).render()


def defined_macros(header_text: str) -> set[str]:
    """The names a header ``#define``s."""
    return {line.split()[1] for line in header_text.splitlines() if line.startswith("#define ")}

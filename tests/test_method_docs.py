"""The README's table of which method for which deployment is the one the other docs point to, and
every method name the docs give (in the table, after ``DPBOARD_METHOD=``, ``--method`` or
``--load-balance-method``) is one the method registry knows. Names are read from the registry (the
rows of ``dpboard.methods.METHODS``), so a method added there needs its row here, and a
method renamed or gone fails wherever a doc still names it."""

from __future__ import annotations

import re

from dpboard.methods import METHOD_CHOICES, METHODS
from dpboard.sim.methods import VLLM_BOARD
from dpboard.sim.peers import PEERS
from tests.support.names import ROOT

README = ROOT / "README.md"
POINTING = [ROOT / "docs" / "DISPATCH.md", ROOT / "docs" / "INTEGRATIONS.md"]
SECTION = "## Which method for which deployment"
ANCHOR = "README.md#which-method-for-which-deployment"
# where a doc sets a method: the value after it must be a registered name
SETTINGS = re.compile(r"(?:DPBOARD_METHOD=|--method[ =]|--load-balance-method[ =])`?([a-z_]+)")


def table_rows() -> list[tuple[str, str]]:
    text = README.read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    assert rows[0].startswith("| deployment | method |") and set(rows[1]) <= set("|- "), rows[:2]
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]
    assert all(len(c) == 2 for c in cells), cells
    return [(deployment, method) for deployment, method in cells]


def test_each_row_names_registered_methods_and_every_method_has_a_row():
    # the controller's methods, and the simulator's names for the deployments it compares them with
    registry = set(METHOD_CHOICES) | set(PEERS) | {VLLM_BOARD}
    named = set()
    for deployment, method in table_rows():
        names = set(re.findall(r"`([a-z_]+)`", method)) - {"auto"}
        assert names, f"the row {deployment!r} names no method"
        assert names <= registry, (deployment, names - registry)
        named |= names
    missing = {m.value for m in METHODS} - named  # a row of the method table needs one in the README's
    assert not missing, f"registered methods without a row in README.md's table: {sorted(missing)}"


def test_the_other_docs_point_to_the_readme_table():
    for doc in POINTING:
        assert ANCHOR in doc.read_text(), f"{doc.name} does not link to the README's table ({ANCHOR})"
    # and keep no table of their own: no heading row of a situation -> method table
    for doc in POINTING:
        assert not re.search(r"^\| situation \| method \|", doc.read_text(), re.M), doc.name


def test_every_method_a_doc_sets_is_registered():
    registry = set(METHOD_CHOICES)
    for doc in [README, *POINTING, ROOT / "docs" / "TOOLS.md"]:
        for m in SETTINGS.finditer(doc.read_text()):
            assert m.group(1) in registry or m.group(1) == "m", f"{doc.name}: {m.group(0)!r} is no registered method"

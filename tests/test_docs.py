"""User docs cite the docs that ship (docs/*.md, README.md), never the product spec or a tracker's
issue numbers, which a user of the package does not have."""

from __future__ import annotations

import re

from tests.support.names import ROOT

UNSHIPPED = re.compile(r"\bSPEC\b|SPEC\.md|(?<!C11 )§\s*\d|\b[Ii]ssues? #?\d+")


def test_user_docs_cite_only_the_docs_that_ship():
    found = []
    for path in sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r} in {line.strip()[:100]!r}"
                      for m in UNSHIPPED.finditer(line)]
    assert not found, "user docs cite what does not ship:\n" + "\n".join(found)

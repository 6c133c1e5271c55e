"""Names a package exports but imports from their modules on first use: ``import dpboard`` and
``import dpboard.board`` then load neither NumPy nor a C extension, which the commands that only
list or remove boards (``dpboard ls``, ``clean``) never need."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``where`` maps each exported name to the module that
    defines it; a name is imported once and then kept in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__

"""vLLM 0.33.0's real modules in a process without torch: the import fixture of the vLLM tests.

The tests import the installed ``vllm==0.33.0`` wheel (``pip install --no-deps``, which ``make test``
does) with the pure-Python packages its modules import (the ``[test]`` extra). vLLM imports torch at
module level almost everywhere (``vllm/__init__.py`` itself, through ``env_override``), for type
annotations, dtype tables and custom-op registration, none of which the scheduler bookkeeping, the
plugin loader, the stats classes or ``DPLBAsyncMPClient``'s pick ever run. ``install()`` therefore
puts stand-ins under the names in ``STAND_INS``, and only those, in ``sys.modules``; vLLM's own
modules all load from the wheel. docs/INTEGRATIONS.md ("How the vLLM side is tested") lists them.

A stand-in package resolves any attribute and any submodule to an inert object: it can be
annotated with, subclassed, called, compared and or-ed (``Tensor | None``). Two torch names need a
real answer, because vLLM checks them while importing: ``torch.__version__`` (the version the
wheel pins, read by ``vllm.utils.torch_version``) and ``torch.library.infer_schema`` (the op schema
string of a Python function, which ``vllm.ir`` compares between an op and its implementations).

transformers, which ``vllm.config`` imports, decides once whether torch is installed; it is asked
before the stand-in exists, so it answers truthfully (no) and never imports the stand-in.

The stand-ins are process-global: the vLLM tests run in a pytest session of their own
(tests/integrations/vllm/test_vllm.py starts it) or in processes of their own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from typing import Any

from tests.support.wheels import wheel_missing

VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.14.0"  # the torch the vLLM 0.33.0 wheel requires (its METADATA)
HOW_TO_GET = (f"install vLLM's wheel alone: `.venv/bin/pip install --no-deps --target .venv/engines vllm=={VLLM_VERSION}` "
              f"(`make test` does it)")

# Every top-level name stood in for, and why. Each needs CUDA-built native code and is imported at
# module level by a vLLM module the tests use.
STAND_INS: dict[str, str] = {
    "torch": "vLLM's package __init__ (env_override), configs, the scheduler's and the clients' modules "
             "import it for annotations, dtypes and op registration; the code under test computes nothing with it",
    "xgrammar": "imported by vllm/parser (structured output, reached from vllm/v1/request.py); itself needs torch",
}


def vllm_missing() -> str | None:
    """Why the vLLM tests cannot run here (None when they can)."""
    missing = wheel_missing("vllm", VLLM_VERSION, "vLLM", HOW_TO_GET)
    if missing:
        return missing
    installed = [name for name in STAND_INS if name not in sys.modules and importlib.util.find_spec(name)]
    if installed:
        return (f"{', '.join(installed)} installed in this environment: the vLLM tests run vLLM's wheel without "
                f"them (`pip uninstall {' '.join(installed)}`)")
    return None


def infer_schema(fn: Any, mutates_args: Any = (), **kwargs: Any) -> str:
    """torch.library.infer_schema's shape: one Tensor per parameter, a Tensor or a tuple of them back.
    vllm.ir only compares these strings between an op and its implementations and counts Tensors."""
    sig = inspect.signature(fn)
    params = ", ".join(f"Tensor {name}" for name in sig.parameters)
    ret = sig.return_annotation
    n = len(getattr(ret, "__args__", ())) if getattr(ret, "__origin__", None) is tuple else 1
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({params}) -> {returns}"


class Inert:
    """Whatever a stand-in module is asked for: usable where vLLM's imports and class bodies use a
    torch object, and doing nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, key: str) -> Inert:
        if key.startswith("__"):
            raise AttributeError(key)
        return Inert(f"{self._name}.{key}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: the function itself
        return Inert(f"{self._name}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)  # `class X(torch.nn.Module)`: a plain class

    def __or__(self, other: Any) -> Inert:
        return self

    __ror__ = __or__

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else self

    __radd__ = __add__

    def __getitem__(self, key: Any) -> Inert:
        return self

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Inert)

    def __hash__(self) -> int:
        return 0

    def __lt__(self, other: object) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class StandInModule(types.ModuleType):
    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        if self.__name__ == "torch.library" and key == "infer_schema":
            return infer_schema
        return Inert(f"{self.__name__}.{key}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the STAND_INS packages and every submodule of theirs to a StandInModule."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.partition(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []
        if spec.name == "torch":
            module.__version__ = TORCH_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Put the stand-ins in place; then ``import vllm...`` loads vLLM's own modules from the wheel."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    reason = vllm_missing()
    if reason:
        raise RuntimeError(reason)
    # transformers caches whether torch is installed; ask it while the answer is the true one
    from transformers.utils import import_utils

    import_utils.is_torch_available()
    sys.meta_path.insert(0, _Finder())

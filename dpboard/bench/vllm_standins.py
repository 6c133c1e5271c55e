"""vLLM's real modules (0.33.0's, or 0.32.0's) in a process without torch: the import stand-ins of the
vLLM tests and of the vLLM rows of ``dpboard bench``.

The tests and the bench import the installed ``vllm==0.33.0`` wheel (``pip install --no-deps``, which
``make test`` does; the vLLM tests run once more on ``vllm==0.32.0``'s, in a folder of its own) with the pure-Python packages its modules import (the ``[test]`` extra). vLLM
imports torch at module level almost everywhere (``vllm/__init__.py`` itself, through
``env_override``), for type annotations, dtype tables and custom-op registration, none of which the
scheduler bookkeeping, the plugin loader, the stats classes or ``DPLBAsyncMPClient``'s pick ever run.
``install()`` therefore puts stand-ins under the names in ``STAND_INS``, and only those, in
``sys.modules``; vLLM's own modules all load from the wheel. docs/INTEGRATIONS.md ("How the vLLM side
is tested") lists them. Nothing imports this module in a vLLM deployment: the plugin never installs it.

A stand-in package resolves any attribute and any submodule to an inert object: it can be
annotated with, subclassed, called, compared and or-ed (``Tensor | None``). Two torch names need a
real answer, because vLLM checks them while importing: ``torch.__version__`` (the version the
wheel pins, read by ``vllm.utils.torch_version``) and ``torch.library.infer_schema`` (the op schema
string of a Python function, which ``vllm.ir`` compares between an op and its implementations).

transformers, which ``vllm.config`` imports, decides once whether torch is installed; it is asked
before the stand-in exists, so it answers truthfully (no) and never imports the stand-in.

The stand-ins are process-global: the vLLM tests run in a pytest session of their own
(tests/integrations/vllm/test_vllm.py starts it) or in processes of their own; the bench takes them
away again (``uninstall``) once its vLLM rows are measured.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

VLLM_VERSION = "0.33.0"  # the newest release the plugin supports: the wheel `make test` puts beside SGLang's
# Every wheel the stand-ins run (the plugin's supported releases), and the torch each requires (its METADATA):
# torch.__version__ answers the one of the wheel that is imported.
VLLM_WHEELS = {"0.33.0": "2.14.0", "0.32.0": "2.13.0"}
TORCH_VERSION = VLLM_WHEELS[VLLM_VERSION]
HOW_TO_GET = (f"install vLLM's wheel alone: `.venv/bin/pip install --no-deps --target .venv/engines vllm=={VLLM_VERSION}` "
              f"(`make test` does it)")

# Every top-level name stood in for, and why. Each needs CUDA-built native code and is imported at
# module level by a vLLM module the tests use.
STAND_INS: dict[str, str] = {
    "torch": "vLLM's package __init__ (env_override), configs, the scheduler's and the clients' modules "
             "import it for annotations, dtypes and op registration; the code under test computes nothing with it",
    "xgrammar": "imported by vllm/parser (structured output, reached from vllm/v1/request.py); itself needs torch",
}


def wheel_missing() -> str | None:
    """Why none of ``VLLM_WHEELS`` can be imported here (None when one can); runs no package ``__init__``."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {HOW_TO_GET}"
    found = importlib.metadata.version("vllm")
    if found not in VLLM_WHEELS:
        return f"vLLM {found} is installed; these stand-ins are for {', '.join(VLLM_WHEELS)}: {HOW_TO_GET}"
    return None


def torch_version() -> str:
    """The torch the imported vLLM wheel requires (the newest's when none of ours is found)."""
    try:
        return VLLM_WHEELS.get(importlib.metadata.version("vllm"), TORCH_VERSION)
    except importlib.metadata.PackageNotFoundError:
        return TORCH_VERSION


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def vllm_missing() -> str | None:
    """Why vLLM's wheel cannot run here behind the stand-ins (None when it can)."""
    missing = wheel_missing()
    if missing:
        return missing
    real = [name for name in STAND_INS if not installed() and name not in sys.modules and importlib.util.find_spec(name)]
    if real:
        return (f"{', '.join(real)} installed in this environment: the stand-ins run vLLM's wheel without "
                f"them (`pip uninstall {' '.join(real)}`)")
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
            module.__version__ = torch_version()
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Put the stand-ins in place; then ``import vllm...`` loads vLLM's own modules from the wheel."""
    if installed():
        return
    reason = vllm_missing()
    if reason:
        raise RuntimeError(reason)
    # transformers caches whether torch is installed; ask it while the answer is the true one
    from transformers.utils import import_utils

    import_utils.is_torch_available()
    sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    """Take the stand-ins away again (a process that goes on to other work: ``dpboard bench all``).
    The vLLM modules loaded meanwhile stay loaded; a later ``import torch`` finds no stand-in."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    for name in [m for m in sys.modules if m.partition(".")[0] in STAND_INS]:
        if isinstance(sys.modules[name], StandInModule):
            del sys.modules[name]


def load_vllm() -> str | None:
    """Make ``import vllm`` work in this process: nothing to do where vLLM imports with its own torch,
    the stand-ins where only its wheel is installed (then ``uninstall()`` after). Why not, or None."""
    if installed():
        return None
    missing = wheel_missing()
    if missing:
        return missing
    if all(importlib.util.find_spec(name) for name in STAND_INS):
        return None  # vLLM's own dependencies are installed: vLLM runs as it is
    reason = vllm_missing()
    if reason:
        return reason
    install()
    return None


@contextmanager
def vllm_importable() -> Iterator[str | None]:
    """``load_vllm()`` for the time of a ``with``: why vLLM cannot be imported, or None; stand-ins
    put in place here are taken away at its end."""
    before = installed()
    reason = load_vllm()
    try:
        yield reason
    finally:
        if not before and installed():
            uninstall()

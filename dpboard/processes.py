"""``module_command``: the command line of a dpboard child process, independent of the directory it
is started from.

``python -m dpboard...`` puts the working directory first on ``sys.path``. Started from the folder
that holds a checkout named ``dpboard/``, the checkout's top folder (which has no ``__init__.py``)
then shadows the installed package as an empty namespace package, and the child fails with
"cannot import name ... from 'dpboard' (unknown location)". Every process dpboard starts itself
goes through here: the interpreter drops that first entry before it imports anything of dpboard.
"""

from __future__ import annotations

import sys

# -c: sys.path[0] is the working directory ('') and sys.argv is ['-c', MODULE, ARGS...].
_BOOT = ("import runpy, sys; del sys.path[0]; sys.argv = sys.argv[1:]; "
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def module_command(module: str, *args: str) -> list[str]:
    """``[python, ..., module, *args]``: run ``module`` as ``python -m`` does, whatever the cwd."""
    return [sys.executable, "-c", _BOOT, module, *args]

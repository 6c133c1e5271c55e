"""The one gap of SGLang 0.5.23's CPU path that ``--enable-dp-attention`` runs into, filled for the
serving tests (tests/support/sglang_serving.py puts this folder on the server's ``PYTHONPATH`` when
``dp_attention=True``); nothing in SGLang's package is changed, and nothing of dpboard's is here.

- **TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value**: under DP attention every rank pads
  its batch to the group's size (``ForwardBatch._pad_inputs_to_size``,
  sglang/srt/model_executor/forward_batch_info.py:2014), and on the CPU asks its attention backend
  for the sequence length of a padding row with ``get_cpu_graph_seq_len_fill_value()``. Only
  ``IntelAMXAttnBackend`` defines it (returning 1); the torch-native backend, the one a CPU without
  AMX runs, does not, and the first request kills both schedulers with an AttributeError. The shim
  gives the torch-native backend the AMX backend's answer, 1: a padding row attends to one token
  of the KV cache, and its output is dropped with the padding.

Python imports ``sitecustomize`` at the start of every process of the server; the method is added
when SGLang's torch-native backend module has run, and only if that SGLang lacks it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"
FILL_VALUE = 1  # IntelAMXAttnBackend.get_cpu_graph_seq_len_fill_value's


def _fill_value(self) -> int:
    return FILL_VALUE


def _patch(module) -> None:
    backend = module.TorchNativeAttnBackend
    if not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = _fill_value


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TORCH_NATIVE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())

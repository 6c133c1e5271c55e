"""Readers for people: what ``dpboard ls/info/dump`` (inspect.py), ``dpboard top`` (top.py) and
``dpboard serve`` (serve.py) show of a board, built on one row model (rows.py) and one sampler that
follows a board by name (watch.py). Nothing here imports Numba or CuPy."""

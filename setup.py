"""The C extensions. Everything else about the package is in pyproject.toml; the extensions are
declared here because setuptools calls its pyproject.toml table for them experimental and warns
three times at every install."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11"]

setup(
    ext_modules=[
        # one module: the slot writer, the board reader, the side records' rows and the owner claim
        # (board_module.h), over the seqlock of dpb_seqlock.h; the layout header is generated from
        # dpboard/snapshot.py
        Extension("dpboard.board._seqlock",
                  ["dpboard/board/board_module.c", "dpboard/board/slot_writer.c", "dpboard/board/board_reader.c",
                   "dpboard/board/side_rows.c", "dpboard/board/claim.c"],
                  include_dirs=["kernels", "dpboard/board"],
                  depends=["kernels/dpboard_layout.h", "dpboard/board/dpb_seqlock.h", "dpboard/board/board_module.h"],
                  extra_compile_args=FLAGS),
        Extension("dpboard.controller._dispatch", ["dpboard/controller/_dispatch.c"], extra_compile_args=FLAGS),
        Extension("dpboard.controller._prefix", ["dpboard/controller/_prefix.c"], extra_compile_args=FLAGS),
    ],
)

"""The environment `make test-sglang-serving` builds for a real ``sglang.launch_server`` on the CPU
(docs/INTEGRATIONS.md, "A real SGLang server on the CPU"). SGLang 0.5.23 itself is installed unchanged
(``--no-deps``), and its previous release, 0.5.22, alone in a folder of the environment that one
server puts first on its PYTHONPATH (the Makefile's ``SGLANG_PREVIOUS_SERVING``: no step here, 0.5.22
runs on 0.5.23's requirements); the steps the Makefile runs in that environment's interpreter:

- ``requirements``: SGLang's own requirements (its metadata, markers evaluated) less the CUDA-only
  packages and torch's media packages, with torch held to the CPU build installed before
  (``constraints``). SGLang pins a newer torch than the CPU build this machine has; it runs on it.
- ``shims``: the two things SGLang's CPU path needs that no registry offers for a CPU torch, each
  outside SGLang's code:

  * **torchvision**: SGLang's config package imports it (a multimodal config). The registry's
    build is a CUDA one whose ``_C`` library does not load beside a CPU torch; its
    ``_meta_registrations.py`` then registers fake kernels for ``torchvision::nms`` and
    ``torchvision::qnms``, ops that do not exist without that library, and the import fails. The
    shim guards those two registrations as the file guards the others (``_has_ops()``). No
    torchvision op is ever called here.
  * **sgl_kernel**: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``sgl_kernel`` at module level;
    its CPU build is on no registry. The shim is the package's Python modules from the
    ``sglang-kernel`` wheel (its CUDA libraries dropped) and a ``common_ops`` library, compiled
    here, that registers the ``sgl_kernel`` op namespace with no op in it. On a CPU without AMX,
    with ``--attention-backend torch_native``, every caller takes its native path; an op called
    anyway fails naming itself.
- ``model DIR``: the tiny Llama of tools/vllm_cpu_env.py (random weights, a BPE trained here);
  ``--arch qwen3``: the same model as a Qwen3, for ``--enable-dp-attention``. SGLang 0.5.23's Llama
  has no DP attention (its attention takes the whole TP size's share of heads, and nothing gathers
  the ranks' tokens around its MLP); its Qwen3 has (``attn_tp`` groups, the layer boundaries).

``python tools/sglang_cpu_env.py check`` says whether the environment is whole (exit 0) or what is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_cpu_env import ARCHS, build_model, no_arguments, requirements_of, run_steps  # noqa: E402  (the same model, rule, steps)

SGLANG = "sglang"
KERNEL_DIST = "sglang-kernel"
# CUDA-only packages (kernels, CUDA bindings, GPU memory tools) and torch's media packages, whose
# registry builds are CUDA ones; a text model on the CPU uses none of them.
LEFT_OUT = {
    "torch", "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl",
    "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "sglang-kernel", "tilelang", "torch-memory-saver", "torchaudio", "torchcodec", "timm", "torchvision",
}
TORCHVISION_VERSION = "0.28.0"
GUARDED_FAKES = ("torchvision::nms", "torchvision::qnms")
SHIM_MARK = "# dpboard shim: "
COMMON_OPS_CPP = """\
// The sgl_kernel op namespace, empty: SGLang's CPU engine imports sgl_kernel, and on a CPU without
// AMX with the torch-native attention backend calls none of its ops. Built by dpboard's
// tools/sglang_cpu_env.py; not SGLang's kernel library.
// sgl_kernel loads it as the Python module common_ops, a module with nothing in it.
#include <Python.h>
#include <torch/library.h>
TORCH_LIBRARY(sgl_kernel, m) {}
static struct PyModuleDef common_ops_module = {PyModuleDef_HEAD_INIT, "common_ops", nullptr, 0, nullptr};
PyMODINIT_FUNC PyInit_common_ops(void) { return PyModule_Create(&common_ops_module); }
"""


def requirements() -> list[str]:
    return requirements_of(SGLANG, LEFT_OUT)


def constraints() -> list[str]:
    """torch held to the installed CPU build, so that no requirement pulls another one in."""
    return [f"torch=={importlib.metadata.version('torch')}"]


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def guard_torchvision() -> Path:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        raise SystemExit("torchvision is not installed: pip install --no-deps torchvision==" + TORCHVISION_VERSION)
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    for op in GUARDED_FAKES:
        decorator = f'@torch.library.register_fake("{op}")'
        guarded = (f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda f: f))'
                   f'  {SHIM_MARK}{op} exists only with torchvision._C')
        if guarded in text:
            continue
        if text.count(decorator) != 1:
            raise SystemExit(f"{path}: expected one {decorator}, found {text.count(decorator)}: "
                             f"this torchvision is not {TORCHVISION_VERSION}")
        text = text.replace(decorator, guarded)
    path.write_text(text)
    return path


def install_sgl_kernel(wheel: Path) -> Path:
    """sgl_kernel's Python modules from the wheel, and the empty ``common_ops`` built here."""
    target = site_packages() / "sgl_kernel"
    target.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            parts = Path(name).parts
            if len(parts) >= 2 and parts[0] == "sgl_kernel" and name.endswith(".py"):
                out = site_packages() / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(name))
    build_common_ops(target)
    return target


def build_common_ops(target: Path) -> Path:
    import torch

    torch_dir = Path(torch.__file__).parent
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = target / f"common_ops{suffix}"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "common_ops.cpp"
        src.write_text(COMMON_OPS_CPP)
        subprocess.run(
            [os.environ.get("CXX", "g++"), "-O1", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{sysconfig.get_paths()['include']}", f"-I{torch_dir / 'include'}",
             f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(src),
             f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)],
            check=True)
    return out


def kernel_wheel(folder: Path) -> Path:
    wheels = sorted(folder.glob("sglang_kernel-*.whl"))
    if not wheels:
        raise SystemExit(f"no sglang_kernel wheel in {folder}: pip download --no-deps sglang-kernel")
    return wheels[-1]


def check() -> list[str]:
    missing = []
    try:
        importlib.metadata.version(SGLANG)
    except importlib.metadata.PackageNotFoundError:
        return ["sglang is not installed"]
    tv = importlib.util.find_spec("torchvision")
    if tv is None or tv.origin is None:
        missing.append("torchvision is not installed")
    elif SHIM_MARK not in (Path(tv.origin).parent / "_meta_registrations.py").read_text():
        missing.append("torchvision's nms/qnms registrations are not guarded (tools/sglang_cpu_env.py shims)")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not (site_packages() / "sgl_kernel" / f"common_ops{suffix}").exists():
        missing.append("sgl_kernel's common_ops is not built (tools/sglang_cpu_env.py shims)")
    if not missing:
        probe = subprocess.run(
            [sys.executable, "-c", "import sgl_kernel, sglang.srt.configs"],
            env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}, capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            missing.append("importing sgl_kernel and sglang.srt.configs fails: "
                           + (probe.stderr.strip().splitlines() or ["?"])[-1])
    return missing


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")


def main(argv: list[str] | None = None) -> int:
    return run_steps(__doc__.split("\n")[0], {
        "requirements": ("print SGLang's requirements less CUDA-only and media packages", no_arguments,
                         lambda args: requirements()),
        "constraints": ("print the constraint that holds torch to the installed build", no_arguments,
                        lambda args: constraints()),
        "shims": ("guard torchvision's two registrations; install sgl_kernel's shim",
                  lambda p: p.add_argument("wheels", type=Path, help="folder holding the downloaded sglang_kernel wheel"),
                  lambda args: [guard_torchvision(), install_sgl_kernel(kernel_wheel(args.wheels))]),
        "model": ("build the tiny model folder", model_arguments, lambda args: build_model(args.folder, args.arch) or []),
        "check": ("exit 0 when the environment is whole", no_arguments, lambda args: check()),
    }, argv)


if __name__ == "__main__":
    sys.exit(main())

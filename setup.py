"""Build glue: pure-Python packaging plus the CUDA library, built by CMake when nvcc is found.

* ``MOE_FP4_BUILD_CUDA=0`` installs pure Python even when nvcc is present;
  ``MOE_FP4_BUILD_CUDA=1`` makes a missing nvcc an error instead of a skip.
* ``MOE_FP4_CUDA_ARCHS`` overrides the CMake architecture lists (see CMakeLists.txt).
* ``MOE_FP4_BUILD_DIR`` keeps the CMake build tree somewhere persistent (faster rebuilds).
* ``CMAKE_BUILD_PARALLEL_LEVEL`` defaults to 2: cicc peaks near 6 GB per CUTLASS unit.

The library (``libmoe_fp4_cuda.so``) has a C ABI and links neither torch nor Python; it is
placed in ``moe_fp4/_lib/`` and loaded lazily with ctypes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_NAME = "libmoe_fp4_cuda.so"


def _find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def _cutlass_include_dirs() -> list[str]:
    try:
        import cutlass_library  # from the nvidia-cutlass wheel (a build requirement)
    except ImportError as exc:  # pragma: no cover - build environment problem
        raise RuntimeError("building the CUDA library needs the nvidia-cutlass==4.2.0.0 package") from exc
    src = Path(cutlass_library.__file__).resolve().parent / "source"
    dirs = [src / "include", src / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise RuntimeError(f"nvidia-cutlass has no C++ headers at {missing}")
    return [str(d) for d in dirs]


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def get_ext_filename(self, ext_name: str) -> str:
        # A plain C library, not a Python extension: no ABI tag in its name.
        return str(Path(*ext_name.split(".")[:-1]) / LIB_NAME)

    def build_extension(self, ext: Extension) -> None:
        nvcc = _find_nvcc()
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        build_dir = Path(os.environ.get("MOE_FP4_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = shutil.which("cmake") or "cmake"
        args = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DMOE_FP4_CUTLASS_INCLUDE_DIRS={';'.join(_cutlass_include_dirs())}",
            f"-DMOE_FP4_LIB_OUTPUT_DIR={out.parent}",
        ]
        ninja = shutil.which("ninja")
        if ninja:
            # pip builds in a fresh isolated environment each time: a build tree kept from an
            # earlier install must not keep pointing at that environment's (deleted) ninja.
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        if os.environ.get("MOE_FP4_CUDA_ARCHS"):
            args.append(f"-DMOE_FP4_CUDA_ARCHS={os.environ['MOE_FP4_CUDA_ARCHS']}")
        if shutil.which("ccache"):
            args.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
        env = dict(os.environ)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        print("moe_fp4: building the CUDA library with", nvcc, flush=True)
        subprocess.run(args, check=True, env=env)
        subprocess.run([cmake, "--build", str(build_dir), "--target", "moe_fp4_cuda"], check=True, env=env)
        built = out.parent / LIB_NAME
        if not built.is_file():
            raise RuntimeError(f"CMake finished but {built} is missing")

    def copy_extensions_to_source(self) -> None:
        # Editable installs copy the library into moe_fp4/_lib/, a folder without a Python package.
        (ROOT / "moe_fp4" / "_lib").mkdir(exist_ok=True)
        super().copy_extensions_to_source()


def _ext_modules() -> list[Extension]:
    flag = os.environ.get("MOE_FP4_BUILD_CUDA", "auto").lower()
    if flag in ("0", "off", "no", "false"):
        print("moe_fp4: MOE_FP4_BUILD_CUDA=0, installing pure Python", file=sys.stderr)
        return []
    if _find_nvcc() is None:
        if flag in ("1", "on", "yes", "true"):
            raise RuntimeError("MOE_FP4_BUILD_CUDA=1 but nvcc was not found (set CUDACXX or PATH)")
        print("moe_fp4: nvcc not found, installing pure Python (no cutlass backend)", file=sys.stderr)
        return []
    return [CMakeExtension("moe_fp4._lib.moe_fp4_cuda")]


def _packages() -> list[str]:
    # moe_fp4/triton_kernels is a symbolic link to triton_kernels/ (so a source tree on
    # PYTHONPATH imports it by its installed name); package_dir below installs the real folder.
    pkgs = [p for p in find_packages(include=["moe_fp4", "moe_fp4.*"]) if not p.startswith("moe_fp4.triton_kernels")]
    pkgs += ["moe_fp4.triton_kernels"] + [
        "moe_fp4.triton_kernels." + p for p in find_packages(where="triton_kernels")
    ]
    return pkgs


setup(
    packages=_packages(),
    # triton_kernels/ installs as moe_fp4.triton_kernels: the top-level name `triton_kernels`
    # belongs to OpenAI's package (which vLLM imports) and must not be shadowed.
    package_dir={"moe_fp4": "moe_fp4", "moe_fp4.triton_kernels": "triton_kernels"},
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)

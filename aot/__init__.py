"""aot: the ahead-of-time CuTeDSL kernel bundle (build on a CPU machine, load on a GPU host).

Shared by `comms` and `moe` (both may import it; it imports neither). A bundle is one directory
per GPU architecture::

    <root>/sm_90a/manifest.json           versions, arch, modules and their export names
    <root>/sm_90a/<module>.so             host launchers + embedded cubin (TVM-FFI entry points)
    <root>/sm_90a/libcute_dsl_runtime.so.xz, apache_tvm_ffi-*.whl, typing_extensions-*.whl
    <root>/sm_90a/setup_device.sh         `source` it on a GPU host without CuTeDSL

`nvl72 kernels build` (see `aot.build`) writes it; at run time `function(module, name)` returns
the exported kernel from the bundle at $NVL72_KERNEL_BUNDLE (a root or an arch directory;
default ~/.cache/nvl72/kernels). Only when no bundle has the module and CuTeDSL is importable does
it JIT-compile the module in-process (development); that choice is logged once per module.
This module imports neither CuTeDSL nor torch at import time, so it works on the GPU host.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import json
import logging
import lzma
import os
import shutil
import sys
import zipfile

log = logging.getLogger(__name__)

ENV_BUNDLE = "NVL72_KERNEL_BUNDLE"
DEFAULT_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "nvl72", "kernels")
RUNTIME_DIR = "/tmp/cutedsl-rt"
SITE_DIR = "/tmp/site"
MANIFEST = "manifest.json"

_modules: dict = {}
_exports: dict = {}
_jit: dict = {}
_runtime = None


class BundleError(RuntimeError):
    """The kernel bundle is missing, for another arch, or lacks the requested kernel."""


def device_arch(device_index: int | None = None) -> str:
    """The bundle arch of a CUDA device: (9, 0) -> sm_90a, (10, 0) -> sm_100a."""
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}a"


def bundle_dir(arch: str, root: str | None = None) -> str:
    """The directory holding `arch`'s bundle ($NVL72_KERNEL_BUNDLE may name it or its parent)."""
    root = root or os.environ.get(ENV_BUNDLE) or DEFAULT_ROOT
    if os.path.isfile(os.path.join(root, MANIFEST)):
        return root
    return os.path.join(root, arch)


def read_manifest(path: str) -> dict:
    mf = os.path.join(path, MANIFEST)
    if not os.path.isfile(mf):
        raise BundleError(f"no kernel bundle at {path!r} (missing {MANIFEST}); build one with "
                          f"`nvl72 kernels build --out DIR` and set {ENV_BUNDLE}")
    with open(mf) as f:
        return json.load(f)


def _load_runtime(path: str):
    """ctypes-load libcute_dsl_runtime.so RTLD_GLOBAL (the kernel .so files need its symbols),
    unpacking the bundle's .xz copy first if no runtime is installed."""
    global _runtime
    if _runtime is not None:
        return
    rt = os.environ.get("CUTE_DSL_RUNTIME")
    if not (rt and os.path.exists(rt)):
        try:
            import cutlass.cute as cute  # a build/dev machine: use the installed runtime
            rt = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
                  if p.endswith("libcute_dsl_runtime.so")][0]
        except ImportError:
            rt = os.path.join(RUNTIME_DIR, "libcute_dsl_runtime.so")
            if not os.path.exists(rt):
                src = os.path.join(path, "libcute_dsl_runtime.so.xz")
                if not os.path.exists(src):
                    raise BundleError(f"no CuTeDSL runtime: neither $CUTE_DSL_RUNTIME, {rt} nor {src}")
                os.makedirs(RUNTIME_DIR, exist_ok=True)
                tmp = f"{rt}.part{os.getpid()}"
                with lzma.open(src) as fi, open(tmp, "wb") as fo:
                    shutil.copyfileobj(fi, fo, 1 << 20)
                os.replace(tmp, rt)
    _runtime = ctypes.CDLL(rt, mode=ctypes.RTLD_GLOBAL)


def _unpack_wheels(path: str, site: str) -> None:
    """Unpack the bundle's apache-tvm-ffi wheel (and typing_extensions where the host's is too old)
    into `site`, once per host: under an exclusive lock, and never over an existing copy, because the
    ranks of a job start together and rewriting a library another process has mapped kills it with
    SIGBUS (seen on 2 x H200 when two ranks unpacked at once)."""
    import fcntl

    whl = sorted(glob.glob(os.path.join(path, "apache_tvm_ffi-*.whl")))
    if not whl:
        raise BundleError(f"tvm_ffi is not installed and the bundle {path!r} carries no wheel")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, ".nvl72-unpack.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(site, "tvm_ffi", "__init__.py")):
            return  # unpacked by another process, or installed there by setup_device.sh
        with zipfile.ZipFile(whl[-1]) as z:
            z.extractall(site)
        try:
            from typing_extensions import get_annotations  # noqa: F401  (tvm_ffi needs >= 4.13)
        except ImportError:
            for te in sorted(glob.glob(os.path.join(path, "typing_extensions-*.whl")))[-1:]:
                with zipfile.ZipFile(te) as z:
                    z.extractall(site)


def _import_tvm_ffi(path: str):
    try:
        import tvm_ffi
        return tvm_ffi
    except ImportError:
        _unpack_wheels(path, SITE_DIR)
        if SITE_DIR not in sys.path:
            sys.path.insert(0, SITE_DIR)
        import tvm_ffi
        return tvm_ffi


def load(module: str, arch: str | None = None):
    """The bundle's compiled `module` (e.g. "comms.kernels.allreduce") as a tvm_ffi.Module."""
    arch = arch or device_arch()
    path = bundle_dir(arch)
    key = (path, module)
    if key not in _modules:
        man = read_manifest(path)
        if man.get("arch") != arch:
            raise BundleError(f"bundle {path!r} is for arch {man.get('arch')!r}, this device needs {arch!r}")
        if module not in man.get("modules", {}):
            raise BundleError(f"bundle {path!r} has no module {module!r} (it has {sorted(man.get('modules', {}))})")
        _load_runtime(path)
        tvm_ffi = _import_tvm_ffi(path)
        so = os.path.join(path, man["modules"][module]["file"])
        _modules[key] = tvm_ffi.load_module(so)
        _exports[key] = set(man["modules"][module]["exports"])
        log.info("aot: loaded %s from %s", module, so)
    return _modules[key]


def function(module: str, name: str, arch: str | None = None, *, jit: bool = True):
    """Kernel `name` exported by `module`: from the bundle, else (jit=True and CuTeDSL present)
    compiled in-process by the module's `compile_for_export(arch)`."""
    arch = arch or device_arch()
    try:
        mod = load(module, arch)
        exports = _exports[(bundle_dir(arch), module)]
        if name not in exports:
            raise BundleError(f"bundle module {module!r} has no kernel {name!r} (it has {sorted(exports)})")
        return getattr(mod, name)
    except BundleError as e:
        if not jit:
            raise
        try:
            importlib.import_module("cutlass.cute")
        except ImportError:
            raise e from None
        key = (module, arch)
        if key not in _jit:
            log.warning("aot: %s; JIT-compiling %s for %s (development path)", e, module, arch)
            _jit[key] = importlib.import_module(module).compile_for_export(arch)
        if name not in _jit[key]:
            raise BundleError(f"{module} exports no kernel {name!r} (it has {sorted(_jit[key])})") from None
        return _jit[key][name]

"""Build the kernel bundle on a machine without a GPU (CuTeDSL compiles against fake tensors).

For each arch and each listed module (`comms.kernels.EXPORTS` + `moe.kernels.EXPORTS` by default):
import it, skip it if its optional `ARCHS` tuple leaves the arch out, call `compile_for_export(arch)`, export every returned function with
`export_to_c(<name>.o, function_name=<name>)`, and link them with the CuTeDSL runtime libraries
into `<module>.so`. Then add what a GPU host without CuTeDSL needs (the runtime as .xz, the
cp312 apache-tvm-ffi wheel, typing_extensions, setup_device.sh) and a manifest. The same steps as
/work/shared/gpu/build-carry.sh, in Python so that `nvl72 kernels build` owns them.

Facts (CuTeDSL 4.8.1): the emitted PTX is ISA 9.4, which a CUDA 13.0 driver cannot JIT, so the
.so holds only the cubin for the exact arch; build for sm_90a (H100/H200) or sm_100a (B200/GB200).
"""
from __future__ import annotations

import datetime
import glob
import hashlib
import importlib
import importlib.metadata as md
import json
import logging
import lzma
import os
import shutil
import subprocess
import sys
import tempfile

from aot import MANIFEST, BundleError

log = logging.getLogger(__name__)

ARCHS = ("sm_90a", "sm_100a")
EXPORT_LISTS = ("comms.kernels", "moe.kernels", "nvl72.kernels")
TVM_FFI_VERSION = "0.1.15.post2"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nvl72", "aot")


def listed_modules() -> list[str]:
    """Every module named by an `EXPORTS` list (a missing package contributes nothing)."""
    mods: list[str] = []
    for pkg in EXPORT_LISTS:
        try:
            exports = importlib.import_module(pkg).EXPORTS
        except ModuleNotFoundError as e:
            if e.name and pkg.startswith(e.name):
                log.info("aot: no %s package, nothing to add from it", pkg)
                continue
            raise
        mods += [m for m in exports if m not in mods]
    return mods


def fake_args(tensors, scalars: int):
    """Compile-time stand-ins of an export's arguments: a flat tensor of symbolic length per (dtype,
    assumed alignment) of `tensors`, then `scalars` Int32s and the caller's stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    return (*(make_fake_compact_tensor(dt, (cute.sym_int(),), assumed_align=align) for dt, align in tensors),
            *(cutlass.Int32(0) for _ in range(scalars)), make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_module(module: str, arch: str, out_dir: str) -> list[str]:
    """Compile `module` for `arch` and link `<out_dir>/<module>.so`; returns its export names
    ([] when the module's `ARCHS` tuple, if it has one, leaves `arch` out)."""
    import cutlass.cute as cute

    if arch not in ARCHS:
        raise BundleError(f"arch={arch!r}: expected one of {ARCHS}")
    mod = importlib.import_module(module)
    if arch not in getattr(mod, "ARCHS", ARCHS):
        return []
    if not hasattr(mod, "compile_for_export"):
        raise BundleError(f"{module} is listed in EXPORTS but defines no compile_for_export(arch)")
    fns = mod.compile_for_export(arch)
    if not fns:
        raise BundleError(f"{module}.compile_for_export({arch!r}) returned no kernels")
    with tempfile.TemporaryDirectory(prefix="nvl72-aot-") as tmp:
        objs = []
        for name, fn in fns.items():
            obj = os.path.join(tmp, f"{name}.o")
            fn.export_to_c(obj, function_name=name)
            objs.append(obj)
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        so = os.path.join(out_dir, f"{module}.so")
        subprocess.run(["gcc", "-shared", "-o", so, *objs, *libs], check=True)
        subprocess.run(["strip", "--strip-unneeded", so], check=False)
    return list(fns)


def _runtime_xz(cache: str) -> str:
    import cutlass.cute as cute

    rt = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False) if p.endswith("libcute_dsl_runtime.so")][0]
    if "/cu13/" not in rt:
        log.warning("aot: the CuTeDSL runtime is not the cu13 flavour: %s", rt)
    with open(rt, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()[:16]
    xz = os.path.join(cache, f"libcute_dsl_runtime.{sha}.so.xz")
    if not os.path.exists(xz):
        log.info("aot: compressing %s (about a minute, cached in %s)", rt, cache)
        with open(rt, "rb") as fi, lzma.open(xz + ".part", "wb", preset=9 | lzma.PRESET_EXTREME) as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        os.replace(xz + ".part", xz)
    return xz


def _wheel(cache: str, pattern: str, spec: str, platform_args: list[str]) -> str:
    found = sorted(glob.glob(os.path.join(cache, pattern)))
    if not found:
        log.info("aot: downloading %s into %s", spec, cache)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", *platform_args, "-d", cache, spec], check=True)
        found = sorted(glob.glob(os.path.join(cache, pattern)))
    if not found:
        raise BundleError(f"could not obtain {spec} (looked for {pattern} in {cache})")
    return found[-1]


def build(out_root: str, archs=("sm_90a",), modules: list[str] | None = None, *, runtime: bool = True,
          cache_dir: str | None = None) -> list[dict]:
    """Write `<out_root>/<arch>/` for each arch; returns the manifests.

    runtime=False leaves out the runtime/wheels/setup script (a compile check, e.g. in tests).
    """
    import cutlass

    modules = listed_modules() if modules is None else list(modules)
    cache = cache_dir or os.environ.get("NVL72_AOT_CACHE") or DEFAULT_CACHE
    manifests = []
    for arch in archs:
        if arch not in ARCHS:
            raise BundleError(f"arch={arch!r}: expected one of {ARCHS}")
        out = os.path.join(out_root, arch)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        man = {"arch": arch, "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "nvidia-cutlass-dsl": md.version("nvidia-cutlass-dsl"), "cutlass": getattr(cutlass, "__version__", ""),
               "apache-tvm-ffi": md.version("apache-tvm-ffi"), "modules": {}, "files": {}}
        for m in modules:
            log.info("aot: compiling %s for %s", m, arch)
            names = compile_module(m, arch, out)
            if names:
                man["modules"][m] = {"file": f"{m}.so", "exports": names}
            else:
                man.setdefault("skipped", []).append(m)
                log.info("aot: %s does not support %s (its ARCHS), skipped", m, arch)
        if runtime:
            os.makedirs(cache, exist_ok=True)
            plat = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64"]
            pieces = [
                (_runtime_xz(cache), "libcute_dsl_runtime.so.xz"),
                (_wheel(cache, f"apache_tvm_ffi-{TVM_FFI_VERSION}-cp312-*.whl",
                        f"apache-tvm-ffi=={TVM_FFI_VERSION}", plat), None),
                (_wheel(cache, "typing_extensions-*-py3-none-any.whl",
                        f"typing_extensions=={md.version('typing_extensions')}", []), None),
                (os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup_device.sh"), None),
            ]
            for src, name in pieces:
                shutil.copy(src, os.path.join(out, name or os.path.basename(src)))
        for f in sorted(os.listdir(out)):
            man["files"][f] = os.path.getsize(os.path.join(out, f))
        with open(os.path.join(out, MANIFEST), "w") as f:
            json.dump(man, f, indent=1)
        log.info("aot: bundle %s: %d modules (%d listed), %.1f MiB", out, len(man["modules"]), len(modules),
                 sum(man["files"].values()) / 2**20)
        manifests.append(man)
    return manifests

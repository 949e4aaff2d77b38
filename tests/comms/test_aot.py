"""The ahead-of-time bundle: every listed CuTeDSL kernel compiles for sm_90a and sm_100a without a
GPU, the .so files export exactly the manifest's names, and `aot` loads them (CPU: load only)."""
import importlib
import json
import os
import subprocess

import pytest

pytest.importorskip("cutlass.cute")
pytest.importorskip("tvm_ffi")

import aot  # noqa: E402
from aot import build  # noqa: E402


def _archs(module: str) -> tuple:
    return getattr(importlib.import_module(module), "ARCHS", build.ARCHS)


def _exported_symbols(so: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", so], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1][len("__tvm_ffi_"):] for line in out.splitlines() if " __tvm_ffi_" in line}


@pytest.mark.slow
def test_bundle_compiles_every_listed_kernel_for_both_archs(tmp_path, monkeypatch):
    import comms.kernels

    listed = build.listed_modules()
    assert set(comms.kernels.EXPORTS) <= set(listed)
    for arch in build.ARCHS:
        build.build(str(tmp_path), [arch], listed, runtime=False)
        on_disk = json.loads((tmp_path / arch / "manifest.json").read_text())
        assert on_disk["arch"] == arch and on_disk["nvidia-cutlass-dsl"]
        for m in listed:
            if arch not in _archs(m):  # the module says it does not target this arch
                assert m in on_disk.get("skipped", [])
                continue
            info = on_disk["modules"][m]
            assert info["exports"], m
            assert _exported_symbols(str(tmp_path / arch / info["file"])) == set(info["exports"])
        ours = on_disk["modules"]["comms.kernels.allreduce"]["exports"]
        algos = ("lamport", "oneshot", "twoshot", "twoshot_symm", "twoshot_push", "twoshot_pipe", "multimem", "rmsnorm",
                 "lamport_rmsnorm")
        assert {f"allreduce_{a}_{d}" for a in algos for d in ("bf16", "fp32")} == set(ours)
    # the loader finds the bundle through the environment and hands out kernels by name
    monkeypatch.setenv(aot.ENV_BUNDLE, str(tmp_path))
    f = aot.function("comms.kernels.allreduce", "allreduce_oneshot_bf16", "sm_90a", jit=False)
    assert callable(f)
    with pytest.raises(aot.BundleError, match="no kernel 'allreduce_nope'"):
        aot.function("comms.kernels.allreduce", "allreduce_nope", "sm_90a", jit=False)


def test_host_constants_match_the_allreduce_kernels():
    import comms.allreduce as host
    import comms.kernels.allreduce as kern

    for name in ("THREADS", "MAX_BLOCKS", "MAX_WORLD", "VEC_BYTES", "PIPE_TILE", "PIPE_STEP", "LAMPORT_SENTINEL",
                 "LAMPORT_EPOCHS", "PUSH_PARTS"):
        assert getattr(host, name) == getattr(kern, name), name


def test_missing_bundle_and_bad_arch_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv(aot.ENV_BUNDLE, str(tmp_path))
    with pytest.raises(aot.BundleError, match=str(tmp_path / "sm_90a")):
        aot.load("comms.kernels.allreduce", "sm_90a")
    with pytest.raises(aot.BundleError, match="arch='sm_80'"):
        build.build(str(tmp_path), ["sm_80"], [], runtime=False)


def test_cli_rejects_unknown_arch(capsys):
    from nvl72.cli import main

    assert main(["kernels", "build", "--arch", "sm_90a,sm_75", "--out", os.devnull]) == 2
    assert "sm_75" in capsys.readouterr().err


def _unpack_and_stat(args):
    bundle, site = args
    aot._unpack_wheels(bundle, site)
    st = os.stat(os.path.join(site, "tvm_ffi", "lib", "libfake.so"))
    return st.st_ino, st.st_mtime_ns, st.st_size


def test_wheel_unpacked_once_by_concurrent_ranks(tmp_path):
    """Ranks that start together unpack the bundle's tvm_ffi wheel once: later ones must not rewrite
    a library the first may have mapped (that was a SIGBUS on the GPU host)."""
    import multiprocessing as mp
    import zipfile

    bundle, site = tmp_path / "bundle", tmp_path / "site"
    bundle.mkdir()
    payload = os.urandom(1 << 20)
    with zipfile.ZipFile(bundle / "apache_tvm_ffi-0.0.0-py3-none-any.whl", "w") as z:
        z.writestr("tvm_ffi/__init__.py", "")
        z.writestr("tvm_ffi/lib/libfake.so", payload)
    with mp.get_context("spawn").Pool(4) as pool:
        stats = pool.map_async(_unpack_and_stat, [(str(bundle), str(site))] * 8, chunksize=1).get(timeout=120)
    assert len(set(stats)) == 1, f"the wheel was unpacked more than once: {stats}"
    assert (site / "tvm_ffi" / "lib" / "libfake.so").read_bytes() == payload
    with pytest.raises(aot.BundleError, match="carries no wheel"):
        aot._unpack_wheels(str(tmp_path / "empty"), str(site))

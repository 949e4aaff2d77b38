"""The fused dispatch/combine kernels compile for Hopper (sm_90a) and Blackwell (sm_100a) on a CPU.

Compilation needs no GPU; it catches CuTeDSL tracing/lowering errors in CI. Running them needs
two GPUs (tests/comms/test_dispatch_gpu.py)."""
import pytest

cute = pytest.importorskip("cutlass.cute")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_dispatch_kernels_compile(arch):
    from comms.kernels import dispatch

    fns = dispatch.compile_for_export(arch, topks=(4,))
    assert sorted(fns) == ["combine_k4", "dispatch_k4", "dispatch_mxfp8_k4", "dispatch_mxfp8_pipe_k4",
                           "dispatch_pipe_k4"]


def test_fake_tensors_are_row_major():
    """Exports take contiguous torch tensors: the compile-time layout must have stride 1 last."""
    import cutlass

    from comms.kernels import dispatch

    t = dispatch.fake_row_major(cutlass.BFloat16, (5, 7), 16)
    assert tuple(t.stride) == (7, 1)


def test_host_mirrors_kernel_constants():
    """comms.dispatch_fused restates the kernel bounds (it must not import CuTeDSL): keep them equal."""
    from comms import dispatch_fused as host
    from comms.kernels import dispatch as k

    assert host.CHUNK_BYTES == k.CHUNK_VEC * 16
    assert (host.MAX_WORLD, host.MAX_LOCAL, host.MAX_PAIRS) == (k.MAX_WORLD, k.MAX_LOCAL, k.MAX_PAIRS)
    assert host.COUNT_MASK == k.COUNT_MASK and k.MAX_PAIRS % k.THREADS == 0
    assert host.TOPK_VARIANTS == k.TOPK_VARIANTS
    assert host.SENTINEL == k.SENTINEL
    assert (host.ARRIVAL_STEP, host.PIPE_MAX) == (k.ARRIVAL_STEP, k.PIPE_MAX)
    assert (host.DISPATCH_PHASES, host.COMBINE_PHASES) == (k.DISPATCH_PHASES, k.COMBINE_PHASES)
    assert len(k.DISPATCH_PHASES) <= k.PROBE_PHASES == host.PROBE_PHASES
    assert {1: k.ERR_DISPATCH_TIMEOUT, 2: k.ERR_COMBINE_TIMEOUT, 3: k.ERR_CAPACITY} == {
        kind: kind << 16 for kind in host._ERR_KINDS}

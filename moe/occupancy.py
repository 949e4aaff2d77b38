"""How many thread-block clusters a device holds at once: the grid of the persistent cluster kernels.

A persistent kernel launched with more clusters than can be co-resident runs the extra ones as a
second wave after the first finishes its whole share of the work (about twice the time of those
tiles). Clusters live inside one GPC, and the GPCs of an H100/H200 have different counts of SMs,
so the number of 2-CTA clusters that fit is at most SMs / 2 and can be lower; the driver knows
(cuOccupancyMaxActiveClusters). The CuTeDSL exports of the kernel bundle do not expose their
CUfunction, so the query runs on a probe kernel with the same launch shape that matters here: one
CTA per SM (the grouped GEMMs use ~200 KB of shared memory; the probe asks for the device's
per-block maximum), the cluster size and the block size. Answered once per (device, shape).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# sm_90 PTX: the driver JIT-compiles it for the device (sm_90 and newer)
_PROBE_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry nvl72_cluster_probe()
{
    ret;
}
\0"""
_cache: dict[tuple[int, int, int], int] = {}


class OccupancyError(RuntimeError):
    """The driver query failed (names the call and the driver's error)."""


def _check(drv, res, what: str):
    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise OccupancyError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return vals[0] if len(vals) == 1 else (vals or None)


def query_max_active_clusters(device_index: int, cluster_size: int, threads: int) -> int:
    """cuOccupancyMaxActiveClusters for a one-CTA-per-SM kernel of `threads` threads launched in
    clusters of `cluster_size` CTAs along x on device `device_index` (raises OccupancyError, or
    ImportError / RuntimeError without cuda-python or a driver)."""
    from cuda.bindings import driver as drv  # lazy: CPU machines need no driver

    _check(drv, drv.cuInit(0), "cuInit")
    dev = _check(drv, drv.cuDeviceGet(device_index), "cuDeviceGet")
    smem = _check(drv, drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev), "cuDeviceGetAttribute")
    ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(drv, drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            mod = _check(drv, drv.cuModuleLoadData(_PROBE_PTX), "cuModuleLoadData(probe)")
            try:
                fn = _check(drv, drv.cuModuleGetFunction(mod, b"nvl72_cluster_probe"), "cuModuleGetFunction")
                _check(drv, drv.cuFuncSetAttribute(
                    fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    "cuFuncSetAttribute")
                attr = drv.CUlaunchAttribute()
                attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster_size, 1, 1
                cfg = drv.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster_size, 1, 1
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
                cfg.sharedMemBytes = smem
                cfg.attrs, cfg.numAttrs = [attr], 1
                return int(_check(drv, drv.cuOccupancyMaxActiveClusters(fn, cfg), "cuOccupancyMaxActiveClusters"))
            finally:
                drv.cuModuleUnload(mod)
        finally:
            drv.cuCtxPopCurrent()
    finally:
        drv.cuDevicePrimaryCtxRelease(dev)


def max_active_clusters(device_index: int, cluster_size: int, threads: int, num_sms: int) -> int:
    """The clusters to launch: the driver's answer, capped at num_sms // cluster_size; if the query
    cannot run (no cuda-python, a driver error) num_sms // cluster_size, with a warning (correct,
    possibly a second wave); below one cluster, OccupancyError. Cached per (device, cluster size, threads)."""
    if cluster_size < 1 or num_sms < cluster_size:
        raise ValueError(f"cluster_size={cluster_size}, num_sms={num_sms}: need 1 <= cluster_size <= num_sms")
    key = (device_index, cluster_size, threads)
    if key not in _cache:
        bound = num_sms // cluster_size
        try:
            n = query_max_active_clusters(device_index, cluster_size, threads)
        except (ImportError, RuntimeError) as e:  # no cuda-python / no driver library / OccupancyError
            log.warning("occupancy: cluster query failed on cuda:%d (%s); launching %d clusters of %d",
                        device_index, e, bound, cluster_size)
            n = bound
        if n < 1:
            raise OccupancyError(f"cuda:{device_index} holds {n} clusters of {cluster_size} CTAs x {threads} threads")
        _cache[key] = min(n, bound)
        log.info("occupancy: cuda:%d holds %d clusters of %d CTAs (%d SMs)", device_index, _cache[key],
                 cluster_size, num_sms)
    return _cache[key]

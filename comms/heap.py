"""Symmetric memory: one equally sized buffer per rank, every rank mapping every peer's buffer.

`SymmetricHeap(group, nbytes)` is the memory that the all-reduce and dispatch/combine kernels
read and write across GPUs (DeepEP's `Buffer` plays this role there). Each rank owns `nbytes`;
`peer_ptrs[r]` is the address, *in this process*, of rank r's buffer, so a kernel given the
table and an offset can load/store any peer's bytes directly (NVLink P2P).

Backends, chosen once at creation and logged:
  * ``cuda``: cuMem (VMM) allocations through cuda-python's driver API. The allocation is
    exported as a FABRIC handle (IMEX; works across the nodes of one NVLink domain) where the
    device and driver allow it, else as a POSIX file descriptor; fds are passed to the other
    processes of the node over a Unix socket with SCM_RIGHTS (never pickle). Every peer's
    allocation is imported and mapped (cuMemMap + cuMemSetAccess) into one reserved VA range.
    A multicast object (NVLink SHARP) is created only when the device reports multicast AND
    the caller passes ``enable_multicast=True`` (nothing in tests/benchmarks does).
  * ``cpu``: the same API over POSIX shared memory (memfd), fds exchanged the same way, so the
    bookkeeping, the fd exchange and the reference collectives run in CI without a GPU.

Layout: callers carve regions with `alloc(nbytes)` (a bump allocator: every rank must make the
same calls in the same order, so offsets are symmetric); regions come back zeroed, and callers
must `barrier()` before peers may write into them. `destroy()` unmaps and frees everything;
views taken from the heap are invalid afterwards.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import os
import socket
import struct
import time
import uuid
from typing import Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_ALIGN = 256


class HeapError(RuntimeError):
    """Symmetric-heap setup, exchange or use failed; the message names the bad value/step."""


@dataclasses.dataclass(frozen=True)
class HeapCapabilities:
    """What the device/driver offers and what this heap uses (logged at creation)."""
    backend: str            # "cuda" | "cpu"
    handle_type: str        # "fabric" | "posix_fd"
    p2p: bool               # every peer's memory is mapped and addressable here
    fabric: bool            # device supports FABRIC handles (IMEX)
    posix_fd: bool          # device supports POSIX fd handles
    multicast: bool         # device reports NVLink multicast support
    multicast_enabled: bool  # a multicast object was actually created (explicit opt-in)


# ------------------------------------------------------------------------------------------
# small helpers: byte all-gather over the group, fd exchange over a Unix socket
# ------------------------------------------------------------------------------------------
def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(group, data: bytes, maxlen: int = 256) -> list[bytes]:
    """All-gather a short byte string per rank as a uint8 tensor (no pickle)."""
    if len(data) > maxlen:
        raise HeapError(f"all_gather_bytes: payload of {len(data)} bytes exceeds maxlen={maxlen}")
    dev = _group_device(group)
    buf = torch.zeros(maxlen + 4, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(struct.pack("<I", len(data))), dtype=torch.uint8)
    if data:
        buf[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    world = dist.get_world_size(group)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    res = []
    for t in out:
        b = bytes(t.cpu().tolist())
        (n,) = struct.unpack("<I", b[:4])
        res.append(b[4:4 + n])
    return res


def _sock_name(tag: str, rank: int) -> str:
    return f"\0nvl72-heap-{tag}-{rank}"  # Linux abstract namespace: nothing to clean up


def exchange_fds(rank: int, world: int, fds: Sequence[int], tag: str, timeout_s: float) -> list[list[int]]:
    """Send this rank's `fds` to every other rank of the node and receive theirs (SCM_RIGHTS).

    Returns one list of fds per rank (our own entry is `fds` itself, not duplicated). The
    received fds are new descriptors owned by the caller (close them when done). Every socket
    operation is bounded by `timeout_s` in total.
    """
    if not 0 <= rank < world:
        raise HeapError(f"exchange_fds: rank={rank} outside world={world}")
    deadline = time.monotonic() + timeout_s
    fds = list(fds)
    result: list[list[int] | None] = [None] * world
    result[rank] = fds
    if world == 1:
        return [fds]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_sock_name(tag, rank))
        listener.listen(world)
        header = struct.pack("<ii", rank, len(fds))
        for peer in range(world):
            if peer == rank:
                continue
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    s.connect(_sock_name(tag, peer))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    s.close()
                    if time.monotonic() > deadline:
                        raise HeapError(f"exchange_fds: rank {rank} could not reach rank {peer} "
                                        f"within timeout_s={timeout_s}") from None
                    time.sleep(0.005)
            with s:
                socket.send_fds(s, [header], fds)
        for _ in range(world - 1):
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                missing = [r for r in range(world) if result[r] is None]
                raise HeapError(f"exchange_fds: rank {rank} got no fds from ranks {missing} "
                                f"within timeout_s={timeout_s}") from None
            with conn:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                msg, got, _, _ = socket.recv_fds(conn, 8, max(1, len(fds)))
                src, count = struct.unpack("<ii", msg[:8])
                if not 0 <= src < world or src == rank or result[src] is not None or len(got) != count:
                    for f in got:
                        os.close(f)
                    raise HeapError(f"exchange_fds: bad message from rank {src} ({len(got)} fds, "
                                    f"expected {count})")
                result[src] = list(got)
    finally:
        listener.close()
    return result  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------
# CPU backend: memfd shared memory
# ------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW, _MAP_SHARED, _MAP_FAILED = 0x1 | 0x2, 0x01, ctypes.c_void_p(-1).value


class _CpuBackend:
    def __init__(self, heap: "SymmetricHeap", timeout_s: float):
        self.nbytes = heap.nbytes
        fd = os.memfd_create(f"nvl72-heap-r{heap.rank}", 0)
        os.ftruncate(fd, self.nbytes)
        self.fds = [fd]
        self.maps: list[int] = []
        try:
            all_fds = exchange_fds(heap.rank, heap.world_size, [fd], heap._tag, timeout_s)
            for r, fl in enumerate(all_fds):
                if r != heap.rank:
                    self.fds.append(fl[0])
                addr = _libc.mmap(None, self.nbytes, _PROT_RW, _MAP_SHARED, fl[0], 0)
                if addr in (None, _MAP_FAILED):
                    raise HeapError(f"mmap of rank {r}'s heap ({self.nbytes} bytes) failed: "
                                    f"errno {ctypes.get_errno()}")
                self.maps.append(addr)
        except BaseException:
            self.close()
            raise
        self.caps = HeapCapabilities("cpu", "posix_fd", True, False, True, False, False)
        self.device = torch.device("cpu")

    def base(self, rank: int) -> int:
        return self.maps[rank]

    def view(self, rank: int) -> torch.Tensor:
        arr = (ctypes.c_uint8 * self.nbytes).from_address(self.maps[rank])
        return torch.frombuffer(arr, dtype=torch.uint8)

    def close(self):
        for a in self.maps:
            _libc.munmap(a, self.nbytes)
        self.maps = []
        for f in self.fds:
            os.close(f)
        self.fds = []


# ------------------------------------------------------------------------------------------
# CUDA backend: cuMem VMM + FABRIC / POSIX-fd handles (+ optional multicast)
# ------------------------------------------------------------------------------------------
def _drv():
    from cuda.bindings import driver  # lazy: the CPU machines need not have a working driver
    return driver


def _check(res, what: str):
    """Unpack a cuda-python (err, *values) tuple, raising HeapError with the call's name."""
    drv = _drv()
    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise HeapError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return vals[0] if len(vals) == 1 else (vals or None)


def device_capabilities(device_index: int) -> dict[str, bool]:
    """Query the driver (queries only: creates nothing)."""
    drv = _drv()
    _check(drv.cuInit(0), "cuInit")
    dev = _check(drv.cuDeviceGet(device_index), "cuDeviceGet")
    A = drv.CUdevice_attribute

    def attr(a):
        return bool(_check(drv.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a})"))
    return {
        "vmm": attr(A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
        "posix_fd": attr(A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
        "fabric": attr(A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED),
        "multicast": attr(A.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED),
    }


class _CudaArray:
    """__cuda_array_interface__ wrapper so torch.as_tensor can view a raw device address."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class _CudaBackend:
    def __init__(self, heap: "SymmetricHeap", timeout_s: float, handle: str, enable_multicast: bool):
        drv = _drv()
        self.drv = drv
        self.device = heap.device
        idx = heap.device.index
        torch.cuda.set_device(idx)
        torch.cuda.init()
        caps = device_capabilities(idx)
        if not caps["vmm"]:
            raise HeapError(f"device cuda:{idx} does not support virtual memory management")
        self.mapped: list[int] = []
        self.handles: list = []
        self.fds: list[int] = []
        self.va = 0
        self.mc_handle = None
        self.mc_va = 0
        T = drv.CUmemAllocationHandleType
        want = {"auto": ["fabric", "posix_fd"], "fabric": ["fabric"], "posix_fd": ["posix_fd"]}.get(handle)
        if want is None:
            raise HeapError(f"handle={handle!r}: expected 'auto', 'fabric' or 'posix_fd'")
        local = None
        chosen = None
        for kind in want:
            if not caps[kind]:
                continue
            prop = drv.CUmemAllocationProp()
            prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = idx
            prop.requestedHandleTypes = (T.CU_MEM_HANDLE_TYPE_FABRIC if kind == "fabric"
                                         else T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            gran = _check(drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity")
            size = -(-heap.nbytes // gran) * gran
            err, h = drv.cuMemCreate(size, prop, 0)
            ok = err == drv.CUresult.CUDA_SUCCESS
            if ok and kind == "fabric":
                err2, fh = drv.cuMemExportToShareableHandle(h, T.CU_MEM_HANDLE_TYPE_FABRIC, 0)
                ok = err2 == drv.CUresult.CUDA_SUCCESS
                if not ok:  # no IMEX channel: fabric supported on paper only
                    drv.cuMemRelease(h)
            # fabric handles must work on every rank, else all fall back together
            if kind == "fabric" and "posix_fd" in want:
                votes = all_gather_bytes(heap.group, b"1" if ok else b"0", 4)
                if votes != [b"1"] * heap.world_size:
                    if ok:
                        drv.cuMemRelease(h)
                    ok = False
            if ok:
                local, chosen, self.size, self.prop, self.gran = h, kind, size, prop, gran
                self.export = fh if kind == "fabric" else None
                break
            log.info("symmetric heap: %s handles unavailable on cuda:%d, trying the next kind", kind, idx)
        if local is None:
            raise HeapError(f"no usable shareable handle type among {want} on cuda:{idx} (caps {caps})")
        self.handles.append(local)
        try:
            self._exchange_and_map(heap, local, chosen, timeout_s)
            mc = bool(enable_multicast and caps["multicast"])
            if enable_multicast and not caps["multicast"]:
                log.warning("symmetric heap: multicast requested but cuda:%d reports none", idx)
            if mc:
                self._setup_multicast(heap, chosen, timeout_s)
        except BaseException:
            self.close()
            raise
        self.caps = HeapCapabilities("cuda", chosen, True, caps["fabric"], caps["posix_fd"],
                                     caps["multicast"], mc)

    def _exchange_and_map(self, heap, local, kind, timeout_s):
        drv, T = self.drv, self.drv.CUmemAllocationHandleType
        world, rank = heap.world_size, heap.rank
        imported: list = [None] * world
        imported[rank] = local
        if kind == "fabric":
            blobs = all_gather_bytes(heap.group, bytes(self.export.data), 64)
            for r, b in enumerate(blobs):
                if r != rank:
                    fh = drv.CUmemFabricHandle()
                    fh.data = b
                    imported[r] = _check(drv.cuMemImportFromShareableHandle(fh, T.CU_MEM_HANDLE_TYPE_FABRIC),
                                         f"cuMemImportFromShareableHandle(fabric, rank {r})")
        else:
            fd = _check(drv.cuMemExportToShareableHandle(local, T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                        "cuMemExportToShareableHandle(posix_fd)")
            self.fds.append(int(fd))
            hosts = all_gather_bytes(heap.group, socket.gethostname().encode()[:200], 200)
            if len(set(hosts)) != 1:
                raise HeapError(f"posix_fd handles need every rank on one host; got hosts {sorted(set(hosts))}")
            all_fds = exchange_fds(rank, world, [int(fd)], heap._tag, timeout_s)
            for r, fl in enumerate(all_fds):
                if r != rank:
                    self.fds.append(fl[0])
                    imported[r] = _check(drv.cuMemImportFromShareableHandle(
                        fl[0], T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                        f"cuMemImportFromShareableHandle(posix_fd, rank {r})")
        self.handles += [h for r, h in enumerate(imported) if r != rank]
        self.va = int(_check(drv.cuMemAddressReserve(self.size * world, self.gran, 0, 0), "cuMemAddressReserve"))
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = heap.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for r in range(world):
            ptr = self.va + r * self.size
            _check(drv.cuMemMap(ptr, self.size, 0, imported[r], 0), f"cuMemMap(rank {r})")
            self.mapped.append(ptr)
            _check(drv.cuMemSetAccess(ptr, self.size, [access], 1), f"cuMemSetAccess(rank {r})")

    def _setup_multicast(self, heap, kind, timeout_s):
        """NVLink SHARP: only reached with enable_multicast=True on a device that reports it."""
        drv, T = self.drv, self.drv.CUmemAllocationHandleType
        prop = drv.CUmulticastObjectProp()
        prop.numDevices = heap.world_size
        prop.size = self.size
        prop.handleTypes = T.CU_MEM_HANDLE_TYPE_FABRIC if kind == "fabric" else T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if heap.rank == 0:
            self.mc_handle = _check(drv.cuMulticastCreate(prop), "cuMulticastCreate")
        if kind == "fabric":
            blob = bytes(_check(drv.cuMemExportToShareableHandle(self.mc_handle, T.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                                "export multicast").data) if heap.rank == 0 else b""
            blob = all_gather_bytes(heap.group, blob, 64)[0]
            if heap.rank != 0:
                fh = drv.CUmemFabricHandle()
                fh.data = blob
                self.mc_handle = _check(drv.cuMemImportFromShareableHandle(fh, T.CU_MEM_HANDLE_TYPE_FABRIC),
                                        "import multicast")
        else:
            mine = [int(_check(drv.cuMemExportToShareableHandle(self.mc_handle, prop.handleTypes, 0),
                               "export multicast"))] if heap.rank == 0 else []
            got = exchange_fds(heap.rank, heap.world_size, mine, heap._tag + "-mc", timeout_s)
            self.fds += mine
            if heap.rank != 0:
                self.fds.append(got[0][0])
                self.mc_handle = _check(drv.cuMemImportFromShareableHandle(got[0][0], prop.handleTypes),
                                        "import multicast")
        dev = _check(drv.cuDeviceGet(heap.device.index), "cuDeviceGet")
        _check(drv.cuMulticastAddDevice(self.mc_handle, dev), "cuMulticastAddDevice")
        heap.barrier()
        _check(drv.cuMulticastBindMem(self.mc_handle, 0, self.handles[0], 0, self.size, 0), "cuMulticastBindMem")
        self.mc_va = int(_check(drv.cuMemAddressReserve(self.size, self.gran, 0, 0), "reserve multicast VA"))
        _check(drv.cuMemMap(self.mc_va, self.size, 0, self.mc_handle, 0), "map multicast")
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = heap.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(drv.cuMemSetAccess(self.mc_va, self.size, [access], 1), "multicast access")
        heap.barrier()

    def base(self, rank: int) -> int:
        return self.mapped[rank]

    def view(self, rank: int) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(self.mapped[rank], self.size), device=self.device)

    def close(self):
        drv = self.drv
        if self.mc_va:
            drv.cuMemUnmap(self.mc_va, self.size)
            drv.cuMemAddressFree(self.mc_va, self.size)
            self.mc_va = 0
        if self.mc_handle is not None:
            dev = drv.cuDeviceGet(self.device.index)[1]
            drv.cuMulticastUnbind(self.mc_handle, dev, 0, self.size)
            drv.cuMemRelease(self.mc_handle)
            self.mc_handle = None
        for p in self.mapped:
            drv.cuMemUnmap(p, self.size)
        self.mapped = []
        if self.va:
            drv.cuMemAddressFree(self.va, self.size * len(self.handles))
            self.va = 0
        for h in self.handles:
            drv.cuMemRelease(h)
        self.handles = []
        for f in self.fds:
            os.close(f)
        self.fds = []


# ------------------------------------------------------------------------------------------
# the public object
# ------------------------------------------------------------------------------------------
class SymmetricHeap:
    """`nbytes` of symmetric memory per rank of `group`, mapped on every rank.

    Args:
        group: a torch.distributed process group (NCCL for GPU heaps, gloo for CPU heaps); only
            used for setup (handle exchange) and `barrier()`.
        nbytes: bytes per rank (rounded up to the allocation granularity on GPU).
        device: a CUDA device for a GPU heap, None/"cpu" for the shared-memory CPU heap.
            Default: the current CUDA device when the group's backend is NCCL, else CPU.
        timeout_s: bound on every step of setup (socket exchange) and on `barrier()`.
        handle: "auto" (fabric, else posix_fd), "fabric" or "posix_fd".
        enable_multicast: create an NVLink multicast object (only if the device reports it).
    """

    def __init__(self, group, nbytes: int, device=None, *, timeout_s: float = 60.0, handle: str = "auto",
                 enable_multicast: bool = False):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise HeapError(f"nbytes={nbytes!r}: expected a positive int")
        if timeout_s <= 0:
            raise HeapError(f"timeout_s={timeout_s!r}: expected > 0")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = nbytes
        self.timeout_s = float(timeout_s)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise HeapError(f"device={device!r}: expected cpu or cuda")
        tag = uuid.uuid4().hex[:16].encode() if self.rank == 0 else b""
        self._tag = all_gather_bytes(group, tag, 16)[0].decode()
        self._offset = 0
        self._destroyed = False
        if self.device.type == "cpu":
            self._b = _CpuBackend(self, self.timeout_s)
        else:
            self._b = _CudaBackend(self, self.timeout_s, handle, enable_multicast)
        self.capabilities: HeapCapabilities = self._b.caps
        self.peer_ptrs = torch.tensor([self._b.base(r) for r in range(self.world_size)],
                                      dtype=torch.int64, device=self.device)  # [world]
        self._local = self._b.view(self.rank)  # [nbytes] uint8
        log.info("symmetric heap: rank %d/%d, %d bytes on %s, %s", self.rank, self.world_size, nbytes,
                 self.device, self.capabilities)
        self.barrier()

    # --- layout -----------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, align: int = DEFAULT_ALIGN) -> int:
        """Reserve a zeroed region; returns its offset (the same on every rank if every rank
        makes the same calls). Call `barrier()` before peers write into it."""
        self._check_alive()
        if nbytes <= 0 or align <= 0 or align & (align - 1):
            raise HeapError(f"alloc(nbytes={nbytes}, align={align}): need nbytes > 0, align a power of two")
        off = -(-self._offset // align) * align
        if off + nbytes > self.nbytes:
            raise HeapError(f"alloc(nbytes={nbytes}): heap of {self.nbytes} bytes has "
                            f"{self.nbytes - off} left at offset {off}")
        self._local[off:off + nbytes].zero_()
        self._offset = off + nbytes
        return off

    @property
    def used(self) -> int:
        return self._offset

    def buffer(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A view of this rank's heap bytes [offset, offset + numel*itemsize) as `shape`/`dtype`."""
        return self._view(self._local, offset, shape, dtype)

    def peer_buffer(self, rank: int, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The same view onto rank `rank`'s heap (mapped here; loads/stores go over NVLink)."""
        self._check_alive()
        if not 0 <= rank < self.world_size:
            raise HeapError(f"rank={rank} outside world_size={self.world_size}")
        if rank == self.rank:
            return self._view(self._local, offset, shape, dtype)
        base = self._b.view(rank)
        if base.data_ptr() != self._b.base(rank):  # torch copied instead of aliasing: refuse
            raise HeapError(f"peer_buffer(rank={rank}): this torch build copies foreign device memory "
                            f"instead of viewing it; use heap.peer_ptrs in a kernel instead")
        return self._view(base, offset, shape, dtype)

    def _view(self, base: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
        self._check_alive()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        if offset < 0 or offset % itemsize or offset + n * itemsize > self.nbytes:
            raise HeapError(f"buffer(offset={offset}, shape={shape}, dtype={dtype}) does not fit "
                            f"a heap of {self.nbytes} bytes (or is misaligned)")
        return base[offset:offset + n * itemsize].view(dtype).view(shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Byte offset of tensor `t`'s data in this rank's heap, or None if it lies outside."""
        self._check_alive()
        if t.device != self.device:
            return None
        off = t.data_ptr() - self._b.base(self.rank)
        nbytes = t.numel() * t.element_size()
        return off if 0 <= off and off + nbytes <= self.nbytes else None

    @property
    def multicast_ptr(self) -> int:
        """Address of the multicast mapping of the heap (0 when multicast is not enabled)."""
        return getattr(self._b, "mc_va", 0)

    # --- sync / teardown --------------------------------------------------------------------
    def barrier(self) -> None:
        """Host barrier over the group, after this rank's queued GPU work is done."""
        self._check_alive()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        work = dist.barrier(group=self.group, async_op=True)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise HeapError(f"barrier: rank {self.rank} failed or timed out (timeout_s={self.timeout_s}): {e}") from e
        if done is False:
            raise HeapError(f"barrier: rank {self.rank} timed out after timeout_s={self.timeout_s}")

    def destroy(self) -> None:
        """Unmap every peer, free the allocation, close the fds. Idempotent."""
        if self._destroyed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._local = None
        self.peer_ptrs = None
        self._b.close()
        self._destroyed = True

    def _check_alive(self):
        if self._destroyed:
            raise HeapError("symmetric heap used after destroy()")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

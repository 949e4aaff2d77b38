"""Shared test configuration: GPU tests skip cleanly on CPU machines (CI)."""
import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# Without a GPU, the Triton kernels' tests run in Triton's CPU interpreter (set before any kernel
# module is imported: triton.jit reads it at decoration time). Runtime kernel choice is by device,
# so the service itself still runs the torch references on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and ngpu == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _default_stream_restored():
    """A GPU test must leave torch's current CUDA stream the default one: kernels decide PDL by the
    stream they launch on (aot.launch), so a leaked side stream changes the next tests' launches."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        leaked = torch.cuda.current_stream() != torch.cuda.default_stream()
        torch.cuda.set_stream(torch.cuda.default_stream())
        assert not leaked, "the test left a non-default CUDA stream current"

"""Engine tests run tiny ops: one torch thread (on a shared 2-core machine OpenMP spin-waiting
between two threads made them ~40x slower), restored afterwards for the rest of the suite."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""The L2 prefetch schedule of captured small decode steps (nvl72.model.prefetch, aot.l2_prefetch):
which weight is forked when (CPU, the Triton backend in the interpreter), the environment's
parsing, and on a GPU greedy tokens of graphs with the prefetch == without."""
import os

import pytest
import torch

from nvl72.model import prefetch
from tests.runner.test_runner_engine import greedy, tiny

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU runs of triton need TRITON_INTERPRET=1")


class Recorder:
    def __init__(self):
        self.calls = []

    def fork(self, t):
        self.calls.append(t)

    def join(self):
        self.calls.append("join")


@INTERPRETED
def test_schedule_forks_o_proj_and_next_qkv_in_layer_order():
    """qwen3_next: layers GDN, attention, GDN, attention. A one-token step forks, in order: layer 1's
    packed q/k/v during layer 0's MoE, layer 1's o_proj after its q/k/v GEMV, layer 3's q/k/v during
    layer 2's MoE, layer 3's o_proj, then joins once; steps of more tokens than MAX_TOKENS fork nothing."""
    pytest.importorskip("triton")
    model = tiny("qwen3_next", "cpu")
    ref, _ = greedy(model, "triton")
    rec = Recorder()
    sched = prefetch.DecodePrefetch(list(model.model.layers), ("o", "qkv"), rec)
    steps = []

    def fake(batch):  # stands in for "a captured step": every step of the eager engine
        steps.append(batch.num_tokens)
        return sched if batch.num_tokens <= 1 else None

    model._prefetch = fake
    got, _ = greedy(model, "triton")
    assert got == ref
    layers = model.model.layers
    one_step = [layers[1].self_attn.packed_qkv_weight, layers[1].self_attn.o_proj.weight,
                layers[3].self_attn.packed_qkv_weight, layers[3].self_attn.o_proj.weight, "join"]
    assert all(w is not None for w in one_step[:-1])
    n = sum(1 for t in steps if t <= 1)
    assert n > 0 and len(rec.calls) == n * len(one_step)
    for i in range(n):
        assert all(a is b for a, b in zip(rec.calls[i * 5:(i + 1) * 5], one_step))


def test_targets_from_env(monkeypatch):
    monkeypatch.delenv(prefetch.ENV, raising=False)
    assert prefetch.targets_from_env() == tuple(t for t in prefetch.DEFAULT.split(",") if t != "0")
    monkeypatch.setenv(prefetch.ENV, "o, qkv")
    assert prefetch.targets_from_env() == ("o", "qkv")
    monkeypatch.setenv(prefetch.ENV, "0")
    assert prefetch.targets_from_env() == ()
    monkeypatch.setenv(prefetch.ENV, "o,down")
    with pytest.raises(ValueError, match=r"NVL72_L2_PREFETCH='o,down'.*'down'"):
        prefetch.targets_from_env()


def test_no_prefetcher_off_cuda(monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "o")
    assert prefetch.for_model([], torch.device("cpu")) is None


def test_bad_method_and_grid_name_the_value(monkeypatch):
    from aot.l2_prefetch import L2Prefetcher

    with pytest.raises(ValueError, match="'bulk'"):
        L2Prefetcher(torch.device("cpu"), "bulk")
    with pytest.raises(ValueError, match="programs=0"):
        L2Prefetcher(torch.device("cpu"), "hint", 0)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["hint", "load"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next"])
def test_graphs_with_l2_prefetch_equal_eager(name, method, monkeypatch):
    monkeypatch.setenv("NVL72_MOE_BACKEND", "reference")
    monkeypatch.setenv(prefetch.ENV, "o,qkv")
    monkeypatch.setenv(prefetch.METHOD_ENV, method)
    model = tiny(name, "cuda")
    eager, _ = greedy(model, "triton")
    got, engine = greedy(model, "triton", graphs=(1, 2, 4, 8))
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert isinstance(model._l2_prefetch, prefetch.DecodePrefetch) and model._l2_prefetch.launcher.method == method
    assert got == eager


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["hint", "load"])
def test_prefetch_kernels_run_on_odd_sizes(method):
    """Sizes that are not whole lines / blocks: the kernels finish and leave the tensor alone."""
    from aot.l2_prefetch import L2Prefetcher

    pf = L2Prefetcher(torch.device("cuda"), method, programs=3, block=256)
    for n in (1, 37, 4097, 1 << 20):
        t = torch.randn(n, device="cuda")
        before = t.clone()
        pf.fork(t)
        pf.join()
        torch.cuda.synchronize()
        assert torch.equal(t, before)

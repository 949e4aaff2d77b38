"""jit_watch: Triton compilations after the warm-up are counted, logged and chained to a hook
that was already installed."""
import logging
import types

import pytest

from nvl72.engine import jit_watch

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def clean_hook():
    saved = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None
    yield
    knobs.runtime.jit_post_compile_hook = saved


def _fire(name):
    # the keyword arguments Triton's JITFunction._call_hook passes (3.6 and 3.9)
    fn = types.SimpleNamespace(module="m", name=name, jit_function=None)  # triton's JitFunctionInfo
    info = {"constants": {(3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    return knobs.runtime.jit_post_compile_hook(key="k", repr=f"{name}[num_warps=4](n: i32)", fn=fn, compile=info,
                                               is_manual_warmup=False, already_compiled=False)


def test_compiles_are_counted_logged_and_chained(clean_hook, caplog):
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    counters = {"triton_compiles": 0}
    assert jit_watch.watch(counters)
    assert jit_watch.watch(counters)  # the same engine again: not a second hook in the chain
    with caplog.at_level(logging.WARNING, logger="nvl72.engine.jit_watch"):
        _fire("_paged_attention_kernel")
        _fire("_gemv_kernel")
    assert counters["triton_compiles"] == 2
    assert seen == ["_paged_attention_kernel[num_warps=4](n: i32)", "_gemv_kernel[num_warps=4](n: i32)"]
    assert "Triton compiled _gemv_kernel" in caplog.text and "constexprs {(3,): 64}" in caplog.text
    assert "tt.divisibility" in caplog.text


def test_engine_warmup_zeroes_counters_and_watches(clean_hook):
    from tests.engine.tiny import make_engine

    engine = make_engine("qwen3_moe")
    engine.warmup(16)
    assert all(v == 0 for v in engine.counters.values())
    _fire("_late_kernel")
    assert engine.counters["triton_compiles"] == 1 and engine.stats()["triton_compiles"] == 1.0

"""Triton compilations after the engine's warm-up, counted and logged.

A Triton kernel compiles on the first launch of each new specialisation (argument dtypes,
divisibility of the non-`do_not_specialize` sizes, constexpr values). In a serving engine that
stalls one step by tens to hundreds of milliseconds, and it only happens for a batch shape the
warm-up (`LLMEngine.warmup`) did not cover, so each one is a warm-up gap worth knowing about:
`watch` counts them into the engine's counters (`triton_compiles`, exported in /metrics) and logs
the kernel with its specialisation. Triton's `jit_post_compile_hook` is one global slot: a hook
already there keeps being called.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def watch(counters: dict) -> bool:
    """Count every later Triton compilation into counters["triton_compiles"]; False when Triton is
    not importable (nothing to watch)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_post_compile_hook
    if getattr(previous, "counters", None) is counters:  # already watching this engine
        return True

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        counters["triton_compiles"] += 1
        info = compile if isinstance(compile, dict) else {}
        log.warning("Triton compiled %s after the engine warm-up (signature %.300s, constexprs %.300s, "
                    "specialisation %.300s): this step stalled for it, a batch shape the warm-up does not cover",
                    getattr(fn, "name", repr), info.get("signature"), info.get("constants"), info.get("configs"))
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None

    hook.counters = counters
    knobs.runtime.jit_post_compile_hook = hook
    return True

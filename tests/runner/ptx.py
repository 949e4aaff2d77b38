"""Compile a Triton kernel for a GPU target on a machine without one, checking its PDL form."""
import os

import pytest

# Triton's interpreter (the CPU suite's TRITON_INTERPRET=1) cannot compile: tests/runner/test_pdl.py
# runs the tests marked with this in a subprocess without it.
COMPILES = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted kernels do not "
                              "compile (tests/runner/test_pdl.py runs this test in a subprocess without the interpreter)")


def compile_pdl(fn, sig: dict, constexprs: dict, pdl: bool, arch: int = 90) -> str:
    """Compile `fn` for sm_`arch` with its `PDL` constexpr set to `pdl` (sig: the runtime arguments'
    types; constexprs: the other constexprs' values). Asserts a cubin and that the PTX has
    griddepcontrol.wait and .launch_dependents exactly when `pdl`; returns the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, {**sig, **{n: "constexpr" for n in constexprs}, "PDL": "constexpr"},
                    constexprs={**constexprs, "PDL": pdl})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"], fn.__name__
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl, fn.__name__
    return ptx

"""CuTeDSL kernels of the model's own layers (not MoE, not comms), compiled ahead of time.

`EXPORTS` lists the modules the `aot` bundle builder compiles; each defines
`compile_for_export(arch) -> {export name: compiled fn}` and `ARCHS`.
  sm90_gemv   one-token bf16 GEMV, each CTA's weight slice bulk-copied into shared memory before its PDL wait"""

EXPORTS = ["nvl72.kernels.sm90_gemv"]

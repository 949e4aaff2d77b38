"""CuTeDSL kernels of the model's own layers (not MoE, not comms), compiled ahead of time.

`EXPORTS` lists the modules the `aot` bundle builder compiles; each defines
`compile_for_export(arch) -> {export name: compiled fn}` and `ARCHS`.
  sm90_gemv   one-token bf16 GEMV, each CTA's weight slice bulk-copied into shared memory before its PDL wait
  sm90_attn   one-token split-key paged attention with the q/k norm and RoPE, a warp per query head
  sm90_layer_stream  a persistent batch-1 step's weight stream without its math (the design's ceiling)"""

EXPORTS = ["nvl72.kernels.sm90_gemv", "nvl72.kernels.sm90_attn", "nvl72.kernels.sm90_layer_stream"]

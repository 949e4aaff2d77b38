"""Device kernels for moe: CuTeDSL modules compiled ahead of time, Triton kernels compiled on the GPU host.

`EXPORTS` lists the CuTeDSL modules the `aot` bundle builder compiles; each defines
`compile_for_export(arch) -> {export name: compiled fn}` and `ARCHS`, the archs it builds for.
  sm90_grouped_gemm   Hopper wgmma grouped GEMM (FP8 with power-of-two block scales, bf16)
  sm90_grouped_gemm_ws  the same FP8 GEMM, warp-specialized and persistent ("ws_*" exports)
  sm100_grouped_gemm  Blackwell tcgen05 MXFP8 block-scaled grouped GEMM (compiled, not yet run)
  sm90_one_token      one-token MoE gate/up and down, their weights bulk-copied into shared memory
  triton_moe          Triton routing / permute+quant / SiLU-and-mul+quant / un-permute (JIT)"""

EXPORTS = ["moe.kernels.sm90_grouped_gemm", "moe.kernels.sm90_grouped_gemm_ws", "moe.kernels.sm100_grouped_gemm",
           "moe.kernels.sm90_one_token"]

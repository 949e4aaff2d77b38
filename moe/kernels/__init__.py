"""Device kernels for moe: CuTeDSL modules compiled ahead of time, Triton kernels compiled on the GPU host.

`EXPORTS` lists the CuTeDSL modules the `aot` bundle builder compiles; each defines
`compile_for_export(arch) -> {export name: compiled fn}`."""

EXPORTS = ["moe.kernels.sm90_grouped_gemm"]

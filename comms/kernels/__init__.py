"""CuTeDSL kernels of comms, compiled ahead of time into the `aot` bundle.

`EXPORTS` lists the kernel modules the bundle builder compiles; each defines
`compile_for_export(arch) -> {export name: compiled fn}` (fake tensors, no GPU needed).
Importing this package imports no CuTeDSL (GPU hosts run from the bundle without it)."""

EXPORTS = ["comms.kernels.allreduce", "comms.kernels.dispatch"]

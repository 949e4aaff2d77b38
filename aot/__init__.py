"""aot: the ahead-of-time CuTeDSL kernel bundle (build on a CPU machine, load on a GPU host).

Shared by `comms` and `moe` (both may import it; it imports neither)."""

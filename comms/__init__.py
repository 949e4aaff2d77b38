"""comms: symmetric memory, all-reduce and MoE dispatch/combine (a library: never imports nvl72)."""

"""Disaggregated prefill -> decode: transfer plans (`plan`: which head ranges of which pages and state
slots go from which prefill TP rank to which decode rank) and their torch.distributed transport
(`transport`: layer group by layer group, bounded waits, the receiver's completion rule)."""

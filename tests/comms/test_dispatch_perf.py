"""`python -m perf.comms dispatch` argument surface; the benchmark itself needs >= 2 GPUs."""
import argparse

import pytest
import torch

from perf.comms import dispatch as bench


def test_arguments_and_gpu_requirement():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--tokens", "1,128", "--hidden", "4096", "--experts", "128", "--nprocs", "1"])
    assert bench._ints(args.tokens) == [1, 128] and args.topk == 8 and args.layout == "contiguous"
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="found 1"):
            bench.run(args)

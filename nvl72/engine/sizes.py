"""The size lists of the CUDA-graph settings ($NVL72_CUDA_GRAPHS, $NVL72_PREFILL_GRAPHS, `nvl72 serve`'s
--cuda-graph-sizes and --prefill-graph-sizes) in one parser, so that all of them accept and refuse alike."""
from __future__ import annotations


def parse_sizes(text: str, name: str, unit: str) -> tuple[int, ...]:
    """`text`, comma-separated positive integers (blanks ignored), sorted without duplicates; () when it
    holds none. A ValueError names `name`, `text` and `unit` ("batch sizes", "token counts") otherwise."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a comma-separated list of {unit}") from None
    if sizes and sizes[0] < 1:
        raise ValueError(f"{name}={text!r}: {unit} must be >= 1")
    return sizes

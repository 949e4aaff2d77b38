"""build_engine's warm path ends by freezing the heap out of the garbage collector's passes."""
import gc

from nvl72.engine.core import build_engine


def test_warm_engine_freezes_the_heap_cold_one_does_not():
    gc.unfreeze()
    try:
        build_engine(None, device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
        assert gc.get_freeze_count() == 0
        engine = build_engine(None, device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                              warmup=True)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the model's modules and tensors, the engine, the imports
        assert not engine.has_unfinished() and engine.pages.num_used == engine.prefix.num_evictable_pages()
    finally:
        gc.unfreeze()

"""moe.occupancy: the cluster count the persistent cluster GEMMs launch (the driver query itself runs on
GPU hosts only: tests/moe/gpu_ws_prefill.sh prints it)."""
import pytest
import torch

from moe import occupancy


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(occupancy, "_cache", {})


def test_driver_answer_is_capped_and_cached(monkeypatch):
    answers = iter([60, 70])
    seen = []

    def query(idx, size, threads):
        seen.append((idx, size, threads))
        return next(answers)

    monkeypatch.setattr(occupancy, "query_max_active_clusters", query)
    assert occupancy.max_active_clusters(0, 2, 384, 132) == 60
    assert occupancy.max_active_clusters(0, 2, 384, 132) == 60  # cached: one query per key
    assert occupancy.max_active_clusters(1, 2, 384, 132) == 66  # 70 > 132 / 2: capped
    assert seen == [(0, 2, 384), (1, 2, 384)]


def test_failed_query_falls_back_to_sms_over_cluster_size(monkeypatch, caplog):
    def query(idx, size, threads):
        raise occupancy.OccupancyError("cuOccupancyMaxActiveClusters failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(occupancy, "query_max_active_clusters", query)
    with caplog.at_level("WARNING", logger="moe.occupancy"):
        assert occupancy.max_active_clusters(0, 2, 384, 131) == 65
    assert "CUDA_ERROR_INVALID_VALUE" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_no_driver_falls_back_to_the_bound():
    with pytest.raises((ImportError, RuntimeError)):
        occupancy.query_max_active_clusters(0, 2, 384)
    assert occupancy.max_active_clusters(0, 4, 128, 132) == 33


def test_zero_clusters_and_bad_shapes_raise(monkeypatch):
    monkeypatch.setattr(occupancy, "query_max_active_clusters", lambda idx, size, threads: 0)
    with pytest.raises(occupancy.OccupancyError, match="holds 0 clusters"):
        occupancy.max_active_clusters(2, 2, 384, 132)
    with pytest.raises(ValueError, match="cluster_size=3, num_sms=2"):
        occupancy.max_active_clusters(0, 3, 384, 2)

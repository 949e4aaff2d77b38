"""The torch.distributed transport under `mpiexec -n 3` (gloo): TP2 prefill -> TP1 decode, layer group
by layer group, bit-exact, the completion rule, and a bounded timeout for a request never sent."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from nvl72.disagg.transport import TransferError, TransferReceipt, layer_groups

HERE = pathlib.Path(__file__).parent


def _mpiexec() -> str:
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.skip("mpiexec (the mpich package) is not installed")
    return exe


@pytest.mark.mp
@pytest.mark.parametrize("transport", ["sendrecv", "p2p"])
def test_transfer_over_gloo_with_mpiexec(transport):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([_mpiexec(), "-n", "3", sys.executable, str(HERE / "transport_worker.py"),
                          "--transport", transport], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"TRANSFER_OK TP2->TP1 on cpu over {transport}" in out.stdout
    assert "TIMEOUT_OK" in out.stdout
    if transport == "p2p":
        assert out.stdout.count("SENDER_TIMEOUT_OK") == 2, out.stdout


def test_receipt_requires_everything_and_the_first_token():
    r = TransferReceipt(5, {(0, 0, "kv"), (1, 0, "kv")})
    r.arrived.add((0, 0, "kv"))
    r.first_token = 17
    assert not r.complete
    with pytest.raises(TransferError, match="rank 1 group 0 kv"):
        r.require_complete()
    r.arrived.add((1, 0, "kv"))
    r.first_token = None
    with pytest.raises(TransferError, match="first token"):
        r.require_complete()
    r.first_token = 17
    assert r.require_complete() == 17


def test_layer_groups():
    assert layer_groups(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="0"):
        layer_groups(5, 0)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.mp
@pytest.mark.parametrize("transport", ["sendrecv", "p2p"])
def test_transfer_over_nccl_with_torchrun(transport):
    """The same transfer between two GPUs (TP1 -> TP1): NCCL through the is_completed() poll path, or
    the rings in NVLink peer memory."""
    root = HERE.parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(HERE / "transport_worker.py"), "--device", "cuda", "--transport", transport],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"TRANSFER_OK TP1->TP1 on cuda:1 over {transport}" in out.stdout


@pytest.mark.parametrize("slot_bytes", [512, 768, 4096])
def test_ring_chunks_cut_parts_into_whole_rows_in_wire_order(slot_bytes):
    """Both ring sides cut a part into the same slot-sized chunks of whole rows: concatenated, the
    chunks gather exactly the part's bytes in wire order; a row larger than a slot is refused."""
    import torch

    from nvl72.disagg.plan import CacheLayout, build_transfer_plan
    from nvl72.disagg.ring import RingError, chunks
    from nvl72.disagg.transport import _parts

    g = torch.Generator().manual_seed(slot_bytes)
    layers, pages = 4, 12
    caches = {"kv": [torch.randn(pages, 2, 2, 4, 8, generator=g).to(torch.bfloat16) if l in (0, 3) else None
                     for l in range(layers)],
              "conv": [torch.randn(3, 44, 3, generator=g) if l in (1, 2) else None for l in range(layers)],
              "recurrent": [torch.randn(3, 4, 6, 5, generator=g) if l in (1, 2) else None for l in range(layers)]}
    src = torch.randperm(pages, generator=g)[:7].tolist()
    plan = build_transfer_plan(CacheLayout(2, 2, 4, 6, 5), 2, 1, src, src, 1, 2)
    parts = _parts(plan, caches, layer_groups(layers, 2), 1, 0, "src")
    cut = chunks(parts, slot_bytes)
    for gi, kind, views in parts:
        mine = [c for c in cut if c.part == (gi, kind)]
        assert all(c.numel() * c.pieces[0].cache.element_size() <= slot_bytes for c in mine)
        got = torch.cat([p.gather() for c in mine for p in c.pieces])
        assert torch.equal(got, torch.cat([v.gather() for v in views]))
    assert len(cut) > len(parts) if slot_bytes == 512 else len(cut) >= len(parts)
    with pytest.raises(RingError, match="recurrent row of 240 bytes"):  # 4 / 2 heads x 6 x 5 fp32
        chunks(parts, 128)

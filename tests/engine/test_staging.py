"""Host staging of a step (nvl72.engine.staging): packed inputs keep every value, and a reused
host buffer is never handed out while a copy may still use it (CUDA events emulated on the host)."""
import array
import random

import pytest
import torch

from nvl72.engine.runner import build_batch
from nvl72.engine.sampler import DeviceSample
from nvl72.engine.protocol import SamplingParams
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.engine.sequence import Sequence
from nvl72.engine.staging import HostRing, pack, unpack


def test_pack_roundtrip_random():
    rnd = random.Random(0)
    for _ in range(50):
        a64 = [array.array("q", [rnd.randrange(-2**62, 2**62) for _ in range(rnd.randrange(0, 9))]) for _ in range(3)]
        a32 = [array.array("i", [rnd.randrange(-2**31, 2**31) for _ in range(rnd.randrange(0, 9))]) for _ in range(3)]
        buf, layout = pack(a64, a32)
        assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0 and buf.numel() > 0
        got = unpack(buf, layout, len(a64))
        for t, a, dt in zip(got, a64 + a32, [torch.int64] * 3 + [torch.int32] * 3):
            assert t.dtype == dt and t.tolist() == list(a)


class Device:
    """A copy queue: events complete when the device has run past them (or on synchronize)."""

    def __init__(self):
        self.queued = 0
        self.done = 0

    def event_class(self):
        dev = self

        class Event:
            def record(self):
                dev.queued += 1
                self.seq = dev.queued

            def synchronize(self):
                dev.done = max(dev.done, self.seq)
        return Event


def test_ring_never_hands_out_a_buffer_in_flight():
    dev = Device()
    ring = HostRing(depth=3, pin=False, event=dev.event_class())
    rnd = random.Random(1)
    in_flight: dict[int, int] = {}  # data_ptr of a buffer -> event sequence of its last copy
    allocated = set()
    for step in range(300):
        n = rnd.choice([8, 64, 512, 5000]) if step % 50 == 0 else rnd.randrange(1, 600)
        buf = ring.take(n)
        assert buf.numel() >= n
        p = buf.data_ptr()
        assert p not in in_flight or dev.done >= in_flight[p], f"step {step}: buffer still in flight"
        allocated.add(p)
        ring.fence()
        in_flight[p] = dev.queued
        dev.done = max(dev.done, dev.queued - rnd.randrange(0, 3))  # the device lags 0-2 copies behind
    assert len(allocated) <= 3 * 4  # reused; grown only a few times (power-of-two sizes)
    with pytest.raises(RuntimeError, match="without a buffer taken"):
        ring.fence()
    with pytest.raises(ValueError, match="depth=1"):
        HostRing(depth=1, pin=False)


def test_ring_ticket_expires_when_the_buffer_is_handed_out_again():
    ring = HostRing(depth=2, pin=False, event=Device().event_class())
    ring.take(16)
    t = ring.ticket()
    ring.fence()
    ring.take(16)
    ring.fence()
    assert ring.valid(t)
    ring.take(16)
    ring.fence()
    assert not ring.valid(t)


def test_device_sample_result_read_once_and_guarded():
    s = DeviceSample(torch.tensor([3, 1, 4]), [None] * 3)
    r = s.result()
    assert r.token_ids == [3, 1, 4] and s.result() is r
    ring = HostRing(depth=2, pin=False, event=Device().event_class())
    ring.take(8)
    late = DeviceSample(torch.tensor([5]), [None])
    late._ring, late._ticket, late.event = ring, ring.ticket(), ring.fence()
    for _ in range(2):
        ring.take(8)
        ring.fence()
    with pytest.raises(RuntimeError, match="handed out again"):
        late.result()


def reference_batch(scheduled, hybrid):
    """The plain per-field construction build_batch must agree with."""
    ids, pos, cu, lens, write, li, rows = [], [], [0], [], [], [], []
    for i, s in enumerate(scheduled):
        seq = s.seq
        known = s.num_new - len(s.drafts)
        ids += seq.all_ids[seq.num_computed:seq.num_computed + known] + s.drafts
        pos += list(range(seq.num_computed, seq.num_computed + s.num_new))
        lens.append(seq.num_computed + s.num_new)
        w = [-1] * s.num_new
        for off, slot in zip(s.write_offsets, s.write_slots):
            w[off] = slot
        write += w
        if s.samples:
            for off in range(known - 1, s.num_new):
                li.append(cu[-1] + off)
                rows.append((i, off))
        cu.append(cu[-1] + s.num_new)
    mp = max([1] + [len(s.seq.pages) for s in scheduled])
    table = [s.seq.pages + [-1] * (mp - len(s.seq.pages)) for s in scheduled]
    out = dict(input_ids=ids, positions=pos, query_start_loc=cu, seq_lens=lens, page_table=table, logits_indices=li)
    if hybrid:
        out.update(state_read_slots=[s.seq.state_slot for s in scheduled], state_write_slots=write)
    return out, rows, max((s.num_new for s in scheduled), default=0)


@pytest.mark.parametrize("hybrid", [False, True])
def test_build_batch_matches_reference(hybrid):
    rnd = random.Random(2 + hybrid)
    for _ in range(40):
        scheduled, fill = [], [[], []]
        for r in range(rnd.randrange(1, 9)):
            n_all = rnd.randrange(2, 40)
            seq = Sequence(f"s{r}", [rnd.randrange(1, 99) for _ in range(n_all)], 1, SamplingParams(), r)
            kind = rnd.choice(["decode", "drafts", "chunk", "last_chunk"])
            drafts = []
            if kind in ("decode", "drafts"):
                seq.num_computed = n_all - 1
                drafts = [rnd.randrange(1, 99) for _ in range(rnd.randrange(1, 4))] if kind == "drafts" else []
                n = 1 + len(drafts)
            else:
                seq.num_computed = rnd.randrange(0, n_all - 1)
                rest = n_all - seq.num_computed
                n = rest if kind == "last_chunk" else rnd.randrange(1, rest)
            seq.pages = [rnd.randrange(0, 500) for _ in range(-(-(seq.num_computed + n) // 4))]
            seq.state_slot = rnd.randrange(0, 50)
            s = ScheduledSeq(seq, n, drafts)
            if hybrid:
                s.write_offsets = sorted(rnd.sample(range(n), rnd.randrange(1, n + 1)))
                s.write_slots = [rnd.randrange(0, 50) for _ in s.write_offsets]
            if rnd.random() < 0.5:
                fill[0].append(rnd.randrange(0, 100))
                fill[1].append(rnd.randrange(0, 100))
            scheduled.append(s)
        batch, rows, fill_t = build_batch(scheduled, 4, hybrid, "cpu", fill)
        ref, ref_rows, max_q = reference_batch(scheduled, hybrid)
        assert rows == ref_rows and batch.max_query_len == max_q
        for name, want in ref.items():
            t = getattr(batch, name)
            assert t.dtype == (torch.int32 if name in ("query_start_loc", "seq_lens", "page_table") else torch.int64)
            assert t.tolist() == want, name
        assert (batch.state_read_slots is None) == (not hybrid)
        assert (fill_t is None and not fill[0]) or fill_t.tolist() == fill

import msgpack
import pytest

from nvl72.engine.protocol import (AbortRequest, AddRequest, LoadReport, ProtocolError, RequestOutput,
                                   SamplingParams, TokenLogprob, decode, encode)


@pytest.mark.parametrize("msg", [
    AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[7], seed=3)),
    AbortRequest("r2"),
    RequestOutput("r3", [4, 5], "stop", 3, 1, [TokenLogprob(4, -0.5, [(4, -0.5), (9, -1.0)])]),
    LoadReport(rank=2, num_running=3, num_waiting=0, kv_usage=0.25, time=1.5, stats={"x": 1.0}),
])
def test_roundtrip(msg):
    assert decode(encode(msg)) == msg


def test_rejects_wrong_version_and_kind():
    with pytest.raises(ProtocolError, match="version"):
        decode(msgpack.packb({"v": 99, "kind": "add", "body": {}}))
    with pytest.raises(ProtocolError, match="'bogus'"):
        decode(msgpack.packb({"v": 1, "kind": "bogus", "body": {}}))
    with pytest.raises(ProtocolError, match="bad fields"):
        decode(msgpack.packb({"v": 1, "kind": "abort", "body": {"nope": 1}}))

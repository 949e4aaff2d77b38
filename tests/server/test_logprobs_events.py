"""SSE chunks with logprobs built from a template (the chunk serialised once per stream) are the
same bytes as `_sse` of the whole chunk, for random texts and random tokens' logprobs."""
import math
import random
from types import SimpleNamespace

import pytest

from nvl72.engine.protocol import TokenLogprob
from nvl72.server.app import OpenAIServer, _sse, _TextEvent
from nvl72.tokenizer import Tokenizer


def _text(rng: random.Random) -> str:
    return "".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(128, 0xD7FF), 0x1F600, 0x2028, 0x22, 0x5C]))
                   for _ in range(rng.randrange(0, 8)))


def _lps(rng: random.Random) -> list[TokenLogprob]:
    def lp():
        return rng.choice([-rng.random() * 30, 0.0, -math.inf, -1e-300])

    return [TokenLogprob(rng.randrange(151936), lp(), [(rng.randrange(151936), lp()) for _ in range(rng.randrange(0, 4))])
            for _ in range(rng.randrange(1, 5))]


def test_logprobs_events_equal_sse():
    rng = random.Random(11)
    server = SimpleNamespace(tok=Tokenizer.qwen(151936))  # what the logprobs builders read
    chunk = {"id": "cmpl-\u00e9", "created": 17, "model": "m \"x\"\u2028", "object": "chat.completion.chunk"}
    chat = _TextEvent(chunk, 'choices": [{"index": 0, "delta": {"content": ', '}, "finish_reason": null, "logprobs": ',
                      '}]}')
    cmpl = _TextEvent(chunk, 'choices": [{"index": 0, "text": ', ', "finish_reason": null, "logprobs": ', '}]}')
    for _ in range(300):
        s, lps = _text(rng), _lps(rng)
        c = OpenAIServer._chat_logprobs(server, lps)
        assert chat(s, c) == _sse({**chunk, "choices": [{"index": 0, "delta": {"content": s}, "finish_reason": None,
                                                         "logprobs": c}]})
        t = OpenAIServer._completion_logprobs(server, lps)
        assert cmpl(s, t) == _sse({**chunk, "choices": [{"index": 0, "text": s, "finish_reason": None,
                                                         "logprobs": t}]})
    with pytest.raises(ValueError, match="takes 1 values after the text, got 0"):
        chat("x")

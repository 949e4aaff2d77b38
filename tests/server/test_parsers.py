"""Streaming parsers: the result does not depend on how the text is split into deltas."""
import json
import random

import pytest

from nvl72.server.parsers import ReasoningParser, StopStrings, ToolCallParser


def _splits(text, rng):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def _run_reasoning(parts, started=False):
    p, r, c = ReasoningParser(started), "", ""
    for part in parts:
        a, b = p.feed(part)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


def _run_tools(parts):
    p, text, calls = ToolCallParser(), "", []
    for part in parts:
        t, cs = p.feed(part)
        text, calls = text + t, calls + cs
    t, cs = p.finish()
    return text + t, [(c.name, json.loads(c.arguments)) for c in calls + cs]


def _run_stop(parts, stops):
    s = StopStrings(stops)
    return "".join(s.feed(x) for x in parts) + s.finish(), s.stopped


CASES_REASONING = [
    ("<think>\nplan <b> steps\n</think>\n\nanswer </thin", False, ("plan <b> steps\n", "answer </thin")),
    ("no think tags here", False, ("", "no think tags here")),
    ("opened in prompt</think>\n\nok", True, ("opened in prompt", "ok")),
    ("<think>unterminated", False, ("unterminated", "")),
    ("<thi", False, ("", "<thi")),
]


@pytest.mark.parametrize("text,started,want", CASES_REASONING)
@pytest.mark.parametrize("seed", range(3))
def test_reasoning_split_independent_of_chunking(text, started, want, seed):
    assert _run_reasoning([text], started) == want
    assert _run_reasoning(_splits(text, random.Random(seed)), started) == want
    assert _run_reasoning(list(text), started) == want


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": [1, "<tool_call>"]}}\n</tool_call>'
CASES_TOOLS = [
    ("Sure.\n" + CALL + "\n" + CALL.replace('"f"', '"g"'), ("Sure.", [("f", {"x": [1, "<tool_call>"]}),
                                                                        ("g", {"x": [1, "<tool_call>"]})])),
    ("plain text <tool_ no call", ("plain text <tool_ no call", [])),
    ("<tool_call>not json</tool_call> after", ("<tool_call>not json</tool_call> after", [])),
    ('<tool_call>{"name": "h", "arguments": {}}', ("", [("h", {})])),  # cut by max_tokens, body complete
]


@pytest.mark.parametrize("text,want", CASES_TOOLS)
@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_independent_of_chunking(text, want, seed):
    assert _run_tools([text]) == want
    assert _run_tools(_splits(text, random.Random(seed))) == want
    assert _run_tools(list(text)) == want


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_independent_of_chunking(seed):
    text = "alpha beta gamma STOP delta"
    for stops, want in ((["STOP"], ("alpha beta gamma ", True)), (["gam", "beta g"], ("alpha ", True)),
                        (["zzz"], (text, False)), ([], (text, False))):
        assert _run_stop([text], stops) == want
        assert _run_stop(_splits(text, random.Random(seed)), stops) == want

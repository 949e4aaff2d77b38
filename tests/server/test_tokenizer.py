"""Tokenizer, chat template and incremental detokenization (nvl72/tokenizer.py)."""
import json
import pathlib
import random

import pytest

from nvl72.tokenizer import (QWEN_ADDED_TOKENS, QWEN_NON_SPECIAL, IncrementalDetokenizer, Tokenizer,
                             TokenizerError, qwen3_chat_format)

HERE = pathlib.Path(__file__).parent
QWEN3_TEMPLATE = (HERE / "qwen3_chat_template.jinja").read_text()
PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — température",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello, wörld! 你好"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "multi_turn_reasoning": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two", "reasoning_content": "thought two"},
    ],
    "tools": [
        {"role": "system", "content": "You are a helper."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 9}"},
    ],
}


def build_tiny_qwen_tokenizer(d: pathlib.Path, template: str | None = QWEN3_TEMPLATE) -> pathlib.Path:
    """A byte-level BPE with Qwen's pre-tokenizer and added tokens (151k-vocab shape in miniature),
    saved as tokenizer.json + tokenizer_config.json carrying the Qwen3 chat template."""
    from tokenizers import Regex, Tokenizer as HFTok, decoders, models, normalizers, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = HFTok(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    tok.add_tokens([AddedToken(t, special=t not in QWEN_NON_SPECIAL, normalized=False)
                    for t in QWEN_ADDED_TOKENS[:26]])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "model_max_length": 4096}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def qwen3():
    return Tokenizer.qwen(151936)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_matches_transformers(tiny_dir, hf_tok, name, thinking):
    msgs = CONVERSATIONS[name]
    tools = TOOLS if name == "tools" else None
    want = hf_tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking)
    ours = Tokenizer.from_dir(tiny_dir)
    assert ours.apply_chat_template(msgs, tools=tools, enable_thinking=thinking) == want
    # The built-in format (used when a checkpoint ships no template) is the same text.
    assert qwen3_chat_format(msgs, tools, True, thinking) == want
    # And token ids agree with transformers' tokenizer on the rendered prompt.
    assert ours.encode(want) == hf_tok.encode(want, add_special_tokens=False)


def test_thinking_off_and_tools_render_as_qwen3(hf_tok):
    text = qwen3_chat_format(CONVERSATIONS["tools"], TOOLS, True, False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert '"name": "get_weather"' in text and "température" in text  # tools JSON, non-ASCII kept
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>" in text


def test_unknown_role_is_rejected():
    with pytest.raises(TokenizerError, match="'robot'"):
        qwen3_chat_format([{"role": "robot", "content": "x"}])


def test_missing_dir_and_bad_vocab_size_name_the_value(tmp_path):
    with pytest.raises(TokenizerError, match="nope"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="1000"):
        Tokenizer.qwen(1000)


def test_qwen_vocabularies_ids(qwen3):
    assert qwen3.token_id("<|im_end|>") == 151645 and qwen3.token_id("</think>") == 151668
    assert qwen3.eos_token_ids == [151645, 151643]
    q35 = Tokenizer.qwen(248320)
    assert q35.token_id("<|endoftext|>") == 248044 and q35.token_id("<think>") == 248068
    for tok in (qwen3, q35):
        text = "<|im_start|>user\nCafé ☕ 東京 <think>x</think><|im_end|>"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == "user\nCafé ☕ 東京 <think>x</think>"
        assert tok.decode(ids + [tok.vocab_size + 5]) == text  # embedding padding ids decode to nothing


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenization_equals_full_decode(qwen3, tiny_dir, seed):
    rng = random.Random(seed)
    tiny = Tokenizer.from_dir(tiny_dir)
    for tok in (qwen3, tiny):
        # Random ids (many are lone UTF-8 bytes) mixed with real multi-byte text and added tokens.
        text_ids = tok.encode("naïve 東京 emoji 😀🚀 done")
        ids = [rng.choice(text_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(300)]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            out, i = [], 0
            while i < len(ids):
                n = rng.randint(1, 3)
                out.append(det.add(ids[i:i + n]))
                i += n
            out.append(det.flush())
            assert "".join(out) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_holds_split_utf8(qwen3):
    ids = qwen3.encode("🫠")
    assert len(ids) > 1  # the emoji is split across byte tokens in this vocabulary
    det = IncrementalDetokenizer(qwen3)
    assert [det.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.add(ids[-1:]) == "🫠"


def test_loads_what_transformers_saves(hf_tok, tmp_path):
    """transformers 5 writes the template to chat_template.jinja beside tokenizer_config.json."""
    hf_tok.save_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    msgs = CONVERSATIONS["tools"]
    want = hf_tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tools=TOOLS) == want
    assert ours.eos_token_ids == [hf_tok.convert_tokens_to_ids("<|im_end|>")]

"""`nvl72 serve` options and the embedded default preset."""
import pytest

from nvl72.cli import CLIError, build_parser, main
from nvl72.commands import serve
from nvl72.config import ModelConfig
from nvl72.presets import DEFAULT_CONFIG, DEFAULT_MODEL_NAME


def _opts(*argv):
    return serve.options(build_parser().parse_args(["serve", *argv]))


def test_defaults_bind_localhost_and_use_the_preset():
    o = _opts()
    assert (o.host, o.port, o.model, o.served_model_name, o.api_key) == ("127.0.0.1", 8000, None, DEFAULT_MODEL_NAME,
                                                                         None)
    assert o.engine_kwargs()["model"] is None and o.enable_prefix_caching
    assert _opts("--device", "cpu").engine == "thread" and _opts("--engine", "process").engine == "process"
    assert _opts("--device", "cpu", "--data-parallel-size", "2").engine_devices() == ["cpu", "cpu"]


def test_options_parse(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    o = _opts("--model", str(tmp_path), "--port", "9001", "--kv-cache-memory", "1.5GiB", "--max-model-len", "4096",
              "--num-speculative-tokens", "2", "--host", "0.0.0.0", "--api-key", "k", "--no-prefix-caching")
    assert o.served_model_name == tmp_path.name and o.port == 9001 and o.kv_cache_bytes == int(1.5 * (1 << 30))
    assert o.engine_kwargs()["num_speculative_tokens"] == 2 and not o.enable_prefix_caching


def test_graph_and_backend_options():
    o = _opts("--attention-backend", "triton", "--cuda-graph-sizes", "8,1,4", "--enforce-eager")
    kw = o.engine_kwargs()
    assert (kw["attention_backend"], kw["cuda_graph_batch_sizes"], kw["enforce_eager"]) == ("triton", (1, 4, 8), True)
    assert _opts().engine_kwargs()["cuda_graph_batch_sizes"] is None  # the engine's default sizes
    assert _opts().engine_kwargs()["prefill_graph_sizes"] is None
    assert _opts("--prefill-graph-sizes", "512,16").engine_kwargs()["prefill_graph_sizes"] == (16, 512)
    assert _opts("--prefill-graph-sizes", "0").engine_kwargs()["prefill_graph_sizes"] == ()
    assert _opts().engine_kwargs()["async_scheduling"] is None  # the engine's default: on with graphs
    assert _opts("--no-async-scheduling").engine_kwargs()["async_scheduling"] is False


def test_engine_graph_sizes_default_on_cuda_only():
    import torch

    from nvl72.engine.engine import EngineConfig, default_graph_sizes

    assert default_graph_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_graph_sizes(6) == (1, 2, 4, 6)
    assert default_graph_sizes(200) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 200)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig(max_num_seqs=16).graph_sizes(cuda) == (1, 2, 4, 8, 16)
    assert EngineConfig(max_num_seqs=16).graph_sizes(cpu) == ()
    assert EngineConfig(enforce_eager=True).graph_sizes(cuda) == ()
    assert EngineConfig(cuda_graph_batch_sizes=()).graph_sizes(cuda) == ()
    assert EngineConfig(cuda_graph_batch_sizes=(2, 4)).graph_sizes(cuda) == (2, 4)


def test_size_lists_parse_alike(monkeypatch):
    """One parser behind the env variables and the serve options: sorted, duplicates and blanks dropped,
    a non-number or a size below 1 refused by name."""
    from nvl72.engine.engine import graph_sizes_from_env
    from nvl72.engine.sizes import parse_sizes

    assert parse_sizes("8, 1,4,,8", "X", "batch sizes") == (1, 4, 8) and parse_sizes(" ", "X", "batch sizes") == ()
    with pytest.raises(ValueError, match="X='1,a' is not a comma-separated list of token counts"):
        parse_sizes("1,a", "X", "token counts")
    monkeypatch.setenv("NVL72_CUDA_GRAPHS", "4,0")
    with pytest.raises(ValueError, match="NVL72_CUDA_GRAPHS='4,0': batch sizes must be >= 1"):
        graph_sizes_from_env()
    monkeypatch.setenv("NVL72_CUDA_GRAPHS", "4,2")
    assert graph_sizes_from_env() == (2, 4)
    with pytest.raises(CLIError, match="--cuda-graph-sizes='0,2': batch sizes must be >= 1"):
        _opts("--cuda-graph-sizes", "0,2")


@pytest.mark.parametrize("argv,named", [
    (["--port", "70000"], "70000"),
    (["--attention-backend", "flash"], "'flash'"),
    (["--cuda-graph-sizes", "1,x"], "'1,x'"),
    (["--cuda-graph-sizes", "1,128"], "--max-num-seqs=64"),
    (["--prefill-graph-sizes", "16,y"], "--prefill-graph-sizes='16,y'"),
    (["--prefill-graph-sizes", "4096"], "--max-num-batched-tokens=2048"),
    (["--port", "http"], "'http'"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--load-format", "gguf"], "'gguf'"),
    (["--dtype", "fp4"], "'fp4'"),
    (["--device", "tpu"], "'tpu'"),
    (["--device", "cuda:9"], "cuda:9"),
    (["--max-model-len", "0"], "--max-model-len=0"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens=-1"),
    (["--max-num-seqs", "0"], "--max-num-seqs=0"),
    (["--kv-cache-memory", "4XB"], "'4XB'"),
    (["--kv-cache-memory=-1GiB"], "'-1GiB'"),
    (["--host", "bad host!"], "'bad host!'"),
    (["--engine", "remote"], "'remote'"),
    (["--data-parallel-size", "0"], "--data-parallel-size=0"),
    (["--device", "cuda:0", "--data-parallel-size", "2"], "--data-parallel-size=2"),
    (["--device", "cuda", "--data-parallel-size", "64"], "--data-parallel-size=64"),
    (["--api-key", " "], "--api-key"),
    (["--served-model-name", " "], "--served-model-name"),
])
def test_bad_values_name_the_value(argv, named, capsys):
    with pytest.raises(CLIError, match=named.replace("-", r"\-").replace(".", r"\.")):
        _opts(*argv)
    assert main(["serve", *argv]) == 2
    assert named in capsys.readouterr().err


def test_model_dir_without_config(tmp_path):
    with pytest.raises(CLIError, match="no config.json"):
        _opts("--model", str(tmp_path))


def test_preset_is_a_tiny_qwen3_5_moe_with_the_real_vocabulary():
    cfg = ModelConfig.from_dict(DEFAULT_CONFIG)
    assert cfg.model_type == "qwen3_5_moe" and cfg.is_hybrid and cfg.has_mtp
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.vocab_size == 248320 and cfg.shared_expert_intermediate_size > 0
    # transformers reads the same dict as a Qwen3.5-MoE config.
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**DEFAULT_CONFIG).text_config
    assert (hf.vocab_size, hf.hidden_size, hf.num_experts, hf.layer_types) == (
        cfg.vocab_size, cfg.hidden_size, cfg.num_experts, cfg.layer_types)
    # The shipped Qwen3.5 vocabulary fits it, and its EOS ids are the config's.
    tok = serve.load_tokenizer(None)
    assert tok.vocab_size <= cfg.vocab_size and tok.eos_token_ids == cfg.eos_token_id
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "<|im_start|>user\nhi<|im_end|>"

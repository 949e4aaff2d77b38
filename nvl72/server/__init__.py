"""The OpenAI-compatible HTTP front.

- `app.build_app(engine, tokenizer, ServerConfig)`: FastAPI app with /v1/chat/completions,
  /v1/completions, /v1/models (behind `Authorization: Bearer <api_key>` when a key is set),
  /health and /metrics (open).
- `openai_protocol`: pydantic request models and `APIError` (OpenAI's error body).
- `parsers`: streaming stop strings, `<think>` reasoning and `<tool_call>` parsers.
- `metrics`: Prometheus metrics under `nvl72:` (front latencies and token counts; engine gauges
  read from `EngineClient.stats()` at scrape time).
- `runner`: uvicorn in the foreground (`nvl72 serve`) or in a thread (`ServerThread`, tests).
"""

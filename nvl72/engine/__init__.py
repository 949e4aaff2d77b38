"""The serving engine: requests, scheduler, runner, sampler, speculative decoding, clients.

A request's life: the front calls `EngineClient.generate(AddRequest)` (`client.py`: the engine in a
thread, or in its own process over ZeroMQ + msgpack, `core.py`). `LLMEngine.add_request`
(`engine.py`) validates it and makes a `Sequence` (`sequence.py`, all per-request state). Each
`LLMEngine.step`:

1. `Scheduler.schedule` (`scheduler.py`) continues running sequences (decode tokens plus drafts, or
   the next prefill chunk) and admits waiting ones under the token budget, looking their prompts
   up in the prefix tree (`nvl72.cache.prefix`) and taking KV pages and GDN state slots from
   reference-counted pools (`nvl72.cache.pool`); under pressure it evicts cached pages, then
   preempts the youngest sequence (recomputed later).
2. `ModelRunner.run` (`runner.py`) flattens the step into one `ForwardBatch`, runs the model over
   the caches and samples the rows that need a token (`sampler.py`).
3. The engine accepts the longest matching prefix of drafts, appends tokens, checks stop
   conditions, and `Scheduler.commit` moves each sequence's KV length and GDN state pointer and
   hands full pages (and page-boundary GDN states) to the prefix tree. Finished and aborted
   sequences give back every page and slot.
4. The drafter (`spec.py`: the MTP head, n-gram lookup, or a test drafter) proposes the next
   step's drafts.
"""

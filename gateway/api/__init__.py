"""The OpenAI-compatible HTTP surface: schemas, errors, SSE, response objects, relays and handlers.

Decision (see `schemas`): tokenization and chat templates happen in the engine agent, which owns its
tokenizer. The gateway sends chat messages, prompt text or token ids; it gets exact prompt token counts back
in the `Admitted` event and exact usage in `Finished`, and detokenized text with each delta. A fleet may mix
models with different tokenizers and the gateway needs none of their files. For routing only, the dispatcher
estimates prompt tokens as ceil(UTF-8 bytes / 4) plus a few per chat message (`gateway.dispatch.features`).
"""

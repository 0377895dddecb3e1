"""API keys and their limits, as pure decisions: who a presented key is, and whether a request may start now.

`keys` owns the key file's model and constant-time authentication; `limits` owns the token buckets and the
per-key admission decision (time is an argument). The HTTP side (headers, status codes, metrics, charging
tokens as they stream) is `gateway.api.access`. No module here imports aiohttp, asyncio or a clock.
"""

"""Messages the gateway cancels a request's task with, so that its layers tell the reasons apart.

Owns: `IDLE_STREAM_CANCEL` (the API's idle-stream bound, `gateway.api.client_guard`: the dispatcher does not
count it as a client disconnect). Must not: import anything.
"""

IDLE_STREAM_CANCEL = "stream_idle_timeout"

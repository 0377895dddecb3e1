"""The gateway ↔ agent link's shared bearer token: one rule for reading it, on both sides of the link.

Owns: `parse_token`, what a token file may hold (the agent's `--auth-token-file` and the gateway's
`engine_link.auth_token_file` read the same files). Must not: import anything of the project, read files
(callers do, and name the file and flag in their errors).
"""

from __future__ import annotations


def parse_token(raw: bytes) -> str:
    """The token in a file's bytes, surrounding whitespace stripped: non-empty printable ASCII, one word (it
    travels as an HTTP/2 header value). ValueError with the reason otherwise."""
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise ValueError("the token must be ASCII") from exc
    if not token:
        raise ValueError("the file is empty (expected one token, e.g. 64 hex digits)")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError("the token must be one word of printable ASCII")
    return token

"""Engine roles the gateway and the agents agree on (CAUCHY's disaggregation).

An agent started with `--role prefill` hands every request off after its first output token (its stream ends
with a migration ticket); the gateway routes new requests away from `--role decode` engines and resumes a
prefill engine's tickets on a decode engine of the same combo (`gateway.dispatch.life`). Any other role
("" or a free-form label) serves whole requests.
"""

from __future__ import annotations

PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"

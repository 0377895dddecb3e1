"""Admin endpoints (only with `--enable-admin`): `POST /admin/migrate` moves a running request.

Owns: the admin routes, their bodies and answers. Who may call: with an API key file, only keys marked
`admin: true` (others get 403); without one, anyone (the gateway is open, and says so at start-up).
`POST /admin/migrate {"request_id": "...", "target": "engine id"?}` cuts the request on its engine for
`target` (omitted: wherever the splice's policy picks) and answers 200 with the cut's figures once the engine
has cut it; the client's stream continues on the target (the dispatcher's splice). 404 unknown request or
engine, 409 refused (a limit, or the engine cannot move it), 503 the engine is unreachable; OpenAI's error
shape. The request id is the engine request id: the API request id for `n = 1`, `{id}-{i}` for choice i.
Must not: route, decide migrations on its own, or log keys.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.api import errors
from gateway.api.access import AccessGate
from gateway.api.errors import ApiError
from gateway.dispatch.mover import MoveError, Mover
from gateway.domain import EngineId


class AdminRoutes:
    def __init__(self, mover: Mover, access: AccessGate) -> None:
        self._mover = mover
        self._access = access

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/migrate", self.migrate)

    def _authorize(self, request: web.Request) -> None:
        key = self._access.authenticate(request.headers)
        if key is not None and not key.admin:
            raise ApiError(
                403, f"API key {key.name!r} is not an admin key", "permission_error", code="admin_required"
            )

    async def migrate(self, request: web.Request) -> web.Response:
        try:
            return await self._migrate(request)
        except ApiError as e:
            return errors.error_response(e)

    async def _migrate(self, request: web.Request) -> web.Response:
        self._authorize(request)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise errors.bad_request(f"the body is not JSON: {e}") from None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("request_id"), str)
            or not body["request_id"]
        ):
            raise errors.bad_request("the body needs a non-empty string 'request_id'", param="request_id")
        target = body.get("target")
        if target is not None and (not isinstance(target, str) or not target):
            raise errors.bad_request("'target' must be a non-empty engine id", param="target")
        try:
            ticket = await self._mover.migrate(body["request_id"], EngineId(target) if target else None)
        except MoveError as e:
            kind = {404: "not_found_error", 409: "conflict_error"}.get(e.status, "service_unavailable")
            raise ApiError(e.status, str(e), kind, code="migration_not_started") from None
        return web.json_response(
            {
                "request_id": ticket.request_id,
                "source": ticket.source_engine_id,
                "target": ticket.target or None,
                "output_tokens": ticket.output_tokens,
                "kv_tokens": ticket.kv_tokens,
                "kv_bytes": ticket.kv_bytes,
            }
        )

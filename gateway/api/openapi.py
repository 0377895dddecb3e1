"""`GET /openapi.json`: an OpenAPI 3.1 description of what the gateway accepts, generated from the request
models.

Owns: `openapi_document()` (the routes, the request bodies as `gateway.api.schemas`' pydantic models validate
them, and the OpenAI error shape every 4xx/5xx carries) and `OpenApiRoute` (serves it, encoded once).
The request schemas are generated, never hand-kept: what `parse_chat` / `parse_completion` accept is what the
document says, and the fuzz tests (tests/fuzz) generate requests from the served document. Response bodies
are described only as far as clients rely on them (object type, SSE media type).
Must not: import the handlers or hold module-level state (the document is built per app).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic.json_schema import models_json_schema

from gateway.api.schemas import ChatCompletionRequest, CompletionRequest

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
_ERRORS = {
    "4XX": {"description": "The request was refused (OpenAI's error shape)", "content": _ERROR},
    "5XX": {"description": "No engine could serve it, or it failed (OpenAI's shape)", "content": _ERROR},
}
_OBJECT = {"schema": {"type": "object"}}
_SSE = {"schema": {"type": "string", "description": "`data: {chunk}` events, then `data: [DONE]`"}}


def _inference(summary: str, body_ref: dict[str, str]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_ref}}},
            "parameters": [
                _header("x-request-id", "Echoed when 1-128 of [A-Za-z0-9._:-]; otherwise one is assigned"),
                _header("x-session-id", "Session affinity key (first 256 characters)"),
                _header("x-slo-ttft-ms", "Time-to-first-token target, positive milliseconds"),
                _header("x-slo-tpot-ms", "Time-per-output-token target, positive milliseconds"),
                _header("x-priority", "Integer; lower runs first where the engine honours priority"),
            ],
            "responses": {
                "200": {
                    "description": "The completion (JSON), or its chunks (SSE) when `stream` is true",
                    "content": {"application/json": _OBJECT, "text/event-stream": _SSE},
                },
                **_ERRORS,
            },
        }
    }


def _header(name: str, description: str) -> dict[str, Any]:
    schema = {"type": "string"}
    return {"name": name, "in": "header", "required": False, "schema": schema, "description": description}


def _get(summary: str, media_type: str) -> dict[str, Any]:
    schema = {"type": "object"} if media_type == "application/json" else {"type": "string"}
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": summary, "content": {media_type: {"schema": schema}}}},
        }
    }


def openapi_document() -> dict[str, Any]:
    refs, defs = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")], ref_template=_REF
    )
    schemas = {**defs.get("$defs", {}), "Error": ERROR_SCHEMA}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Switchyard gateway",
            "version": "1",
            "description": "OpenAI-compatible inference API. Unknown body fields are ignored; known ones are "
            "type-checked strictly.",
        },
        "paths": {
            "/v1/chat/completions": _inference(
                "Chat completion", refs[(ChatCompletionRequest, "validation")]
            ),
            "/v1/completions": _inference("Text completion", refs[(CompletionRequest, "validation")]),
            "/v1/models": _get("Served models", "application/json"),
            "/v1/plan": _get("The configured CAUCHY plan next to the fleet by combo, and the autoscaler's "
                             "state when it runs (404 without a plan)",
                             "application/json"),
            "/v1/cascades": _get("The cascades served as models: their thresholds now and, when they "
                                 "re-plan, the current window, the last shift tests and the re-plan history "
                                 "(404 without cascades)", "application/json"),
            "/health": _get("Readiness (503 while no engine is ready or while draining)", "application/json"),
            "/metrics": _get("Prometheus exposition", "text/plain"),
            "/openapi.json": _get("This document", "application/json"),
        },
        "components": {"schemas": schemas},
    }


class OpenApiRoute:
    """The document, encoded once per app."""

    __slots__ = ("_body",)

    def __init__(self) -> None:
        self._body = orjson.dumps(openapi_document())

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self._body, content_type="application/json")

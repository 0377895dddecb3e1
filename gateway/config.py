"""The gateway's one configuration tree: typed, frozen, unknown keys rejected.

Owns: `GatewayConfig` and its sub-models, loading from a YAML or JSON file, the environment overrides (applied
in `env_overrides`, the only place the environment is read), merging CLI flags, and the path-named
`ConfigError`. Precedence, lowest first: defaults on the models < file < environment < CLI flags.
Must not: import aiohttp, grpc or the policies; start anything; silently rewrite a value (validators reject).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from gateway.planning.autoscaler import AutoscalerParams

ENV_PREFIX = "SWITCHYARD_GATEWAY_"
MIB = 1024 * 1024

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


def _check_host_port(address: str) -> str:
    m = _HOST_PORT.match(address)
    if m is None or not 0 < int(m.group("port")) < 65536:
        raise ValueError(f"invalid engine address {address!r} (expected host:port)")
    return address


def _check_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise ValueError(f"invalid upstream URL {url!r} (expected http(s)://host:port[/path])")
    return url


EngineAddress = Annotated[str, AfterValidator(_check_host_port)]
UpstreamUrl = Annotated[str, AfterValidator(_check_url)]


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad field by its path (`engines.1: ...`)."""


def load_plan_document(path: str) -> dict[str, Any]:
    """A plan file's JSON document, checked by `gateway.planning.plan_file.parse_plan`; ConfigError naming the
    file and the problem."""
    from gateway.planning.plan_file import parse_plan  # noqa: PLC0415

    try:
        doc = json.loads(Path(path).read_text())
        parse_plan(doc)
    except OSError as e:
        raise ConfigError(f"plan_file {path}: {e.strerror or e}") from None
    except ValueError as e:  # json.JSONDecodeError included
        raise ConfigError(f"plan_file {path}: {str(e).splitlines()[0]}") from None
    assert isinstance(doc, dict)
    return doc


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PolicyConfig(_Frozen):
    name: str = Field("round_robin", min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class SloConfig(_Frozen):
    """Defaults applied when a request carries no `x-slo-*` header (None = no target)."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


class ClientLimitsConfig(_Frozen):
    """Time bounds on what one HTTP client can hold of the gateway (docs/security.md, "Hostile clients").
    Request-shape bounds (n, stop, messages) are the API's own, in `gateway.api.schemas`; the body size is
    `max_body_bytes`."""

    # A connection must complete its request head within this long of opening or of its previous response,
    # else it is closed (aiohttp's keep-alive timer: idle keep-alive connections close after it too).
    header_read_timeout_s: float = Field(30.0, gt=0)
    body_read_timeout_s: float = Field(30.0, gt=0)  # head to the body's last byte; then 408
    # A stream the engines sent no event for this long ends with an error event (the client-facing bound;
    # the dispatcher's engine-stall detection judges the engine).
    idle_stream_timeout_s: float = Field(120.0, gt=0)
    # A response write the client does not read for this long aborts the request (the engine aborts too).
    slow_client_timeout_s: float = Field(30.0, gt=0)


class EngineLinkConfig(_Frozen):
    """How the gateway authenticates to its engine agents and checks them (docs/security.md): paths, read at
    start by `gateway.engines.grpc_link`. The agents decide what they demand; these must match it."""

    tls: bool = False  # connect over TLS (the agents run with --tls-cert/--tls-key)
    tls_ca_file: str | None = Field(None, min_length=1)  # CA of the agents' certificates; None = system CAs
    tls_cert_file: str | None = Field(None, min_length=1)  # mutual TLS: the gateway's client certificate ...
    tls_key_file: str | None = Field(None, min_length=1)  # ... and its key
    # The name the agents' certificates must carry; None = the host of each engine address.
    tls_server_name: str | None = Field(None, min_length=1)
    auth_token_file: str | None = Field(None, min_length=1)  # sent as `authorization: Bearer <token>`

    @model_validator(mode="after")
    def _consistent(self) -> EngineLinkConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together (a client certificate and its key)")
        if not self.tls:
            given = [n for n in ("tls_ca_file", "tls_cert_file", "tls_server_name") if getattr(self, n)]
            if given:
                raise ValueError(f"{', '.join(given)} given but tls is false (set tls: true / --engine-tls)")
        return self


class OutlierConfig(_Frozen):
    """Passive outlier detection (gateway.cluster.health): consecutive failures eject an engine for
    base_ejection_s * 2**(ejections - 1), capped; then one half-open probe decides."""

    consecutive_failures: int = Field(5, ge=1)
    base_ejection_s: float = Field(5.0, gt=0)
    max_ejection_s: float = Field(60.0, gt=0)
    max_ejected_ratio: float = Field(0.5, ge=0, le=1)  # of a model's engines (at least one may go)

    @model_validator(mode="after")
    def _ordered(self) -> OutlierConfig:
        if self.base_ejection_s > self.max_ejection_s:
            raise ValueError("base_ejection_s must not exceed max_ejection_s")
        return self


class RetryConfig(_Frozen):
    """Retries before the first byte (gateway.dispatch.retry): a budget over a sliding window and jittered
    exponential backoff between attempts."""

    budget_ratio: float = Field(0.2, ge=0)  # retries per started request, over the window
    min_retries_per_s: float = Field(1.0, ge=0)
    window_s: float = Field(10.0, gt=0)
    base_backoff_s: float = Field(0.025, ge=0)
    max_backoff_s: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> RetryConfig:
        if self.base_backoff_s > self.max_backoff_s:
            raise ValueError("base_backoff_s must not exceed max_backoff_s")
        return self


class AdmissionConfig(_Frozen):
    """Admission control (gateway.admission): a bounded priority queue per model in front of the fleet's
    slots, shedding at once (503 fleet_saturated + Retry-After) what cannot meet its TTFT SLO."""

    enabled: bool = True
    max_queue: int = Field(1024, ge=0)  # per model
    default_engine_slots: int = Field(256, ge=1)  # concurrent requests of an engine that does not say
    rate_window_s: float = Field(10.0, gt=0)  # completions counted for the queue-wait estimate
    # The queue-wait estimate is scaled by this quantile of recent actual/predicted waits (split-conformal):
    # the share of admitted requests that should wait no longer than predicted.
    slo_quantile: float = Field(0.99, gt=0, le=1)
    calibration_samples: int = Field(512, ge=1)
    # Refuse a queued request (503 fleet_saturated, reason slo_expired) once its TTFT SLO has passed while it
    # waited: it can no longer meet it, and its slot would be taken from one that still can.
    shed_expired: bool = True


class RescheduleConfig(_Frozen):
    """Moving running requests between engines (STAR; gateway.dispatch.mover, gateway.rescheduling)."""

    # "none": no rescheduler runs (migrations only through /admin/migrate); "star": STAR's Algorithm 1 with
    # the agents' length predictions; "star-nopred": the same on current load only (the paper's ablation);
    # "length_stages": CascadeInfer's stages, refinement, hand-over and bid-ask (docs/cascadeinfer.md), which
    # paces its own transfers: the mover's cooldowns do not apply and its per-request limit is the
    # rescheduler's `max_migrations_per_request`. The agents must report their requests (`--star-report`).
    policy: Literal["none", "star", "star-nopred", "length_stages"] = "none"
    interval_s: float = Field(0.5, gt=0)  # how often the rescheduler looks
    max_migrations_per_request: int = Field(2, ge=0)
    request_cooldown_s: float = Field(5.0, ge=0)  # a request is not cut again within this
    engine_cooldown_s: float = Field(1.0, ge=0)  # an engine sits out new migrations this long after one
    # The rescheduler's own parameters (gateway.rescheduling.star.StarParams or length_stages.
    # LengthStagesParams fields); unknown keys are an error at start-up.
    params: dict[str, float | int | bool | str] = Field(default_factory=dict)


class AutoscaleConfig(_Frozen):
    """CAUCHY's combo autoscaler in the gateway (gateway.fleet.autoscale; Algorithm 1 in
    gateway.planning.autoscaler): it needs `plan_file` (what is deployed, and what to re-plan over) and one
    gateway process (it counts the arrivals; a worker of several sees only its share)."""

    enabled: bool = False
    step_s: float = Field(10.0, gt=0)  # one QPS sample (arrivals / step_s) per step
    # Algorithm 1's parameters (gateway.planning.autoscaler.AutoscalerParams), the paper's defaults.
    ratio: float = Field(0.2, gt=0, lt=1)
    local_window_s: float = Field(120.0, gt=0)
    global_window_s: float = Field(1800.0, gt=0)
    provisioning_s: float = Field(90.0, ge=0)
    grace_s: float = Field(30.0, ge=0)
    min_copies: int = Field(1, ge=0)  # a scale-in keeps at least this many combo copies

    def params(self) -> AutoscalerParams:
        """Algorithm 1's parameters, checked by `AutoscalerParams` itself (ValueError)."""
        from gateway.planning.autoscaler import AutoscalerParams  # noqa: PLC0415

        return AutoscalerParams(self.ratio, self.local_window_s, self.global_window_s, self.provisioning_s,
                                self.grace_s, self.min_copies)

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleConfig:
        self.params()  # the rules across fields (local window <= global window) are the autoscaler's
        return self


class JudgeConfig(_Frozen):
    """The LLM judge of a cascade (gateway.cascade.judge): who scores a stage's answer, and how."""

    # "openai": any OpenAI-compatible chat endpoint (`url`, `model`); "cluster": a model this gateway serves
    # (`model`), dispatched like any request; "profile": scores looked up in a quality profile by question
    # text
    # and judged model (the simulated fleet only: it never reads the answer).
    kind: Literal["openai", "cluster", "profile"]
    url: UpstreamUrl | None = None  # openai: the base URL, e.g. http://judge:8080/v1
    model: str | None = Field(None, min_length=1)  # openai and cluster: the judge model's name
    api_key: str | None = Field(None, min_length=1)  # openai: sent as a bearer token
    timeout_s: float = Field(2.0, gt=0)  # a verdict later than this is a failure (on_judge_failure applies)
    # "rating": FastChat's single-answer template asking for `Rating: [[k]]` only (a few tokens);
    # "explain": FastChat's template verbatim (an explanation, then the rating).
    output: Literal["rating", "explain"] = "rating"
    max_tokens: int | None = Field(None, ge=1)  # None: 8 for rating, 1024 for explain
    profile: str | None = Field(None, min_length=1)  # profile: a quality-profile JSON; None = the shipped one
    failures_to_skip: int = Field(5, ge=1)  # this many failed verdicts in a row ...
    # ... skip the judge this long (on_judge_failure applies, reason "skipped")
    skip_s: float = Field(10.0, ge=0)

    @model_validator(mode="after")
    def _complete(self) -> JudgeConfig:
        if self.kind == "openai" and (self.url is None or self.model is None):
            raise ValueError("an openai judge needs url and model")
        if self.kind == "cluster" and self.model is None:
            raise ValueError("a cluster judge needs model (a model this gateway serves)")
        return self


class CascadeStageConfig(_Frozen):
    model: str = Field(min_length=1)
    # Accept this stage's answer when the judge scores it at least this (0-100); the last stage has none.
    threshold: float | None = Field(None, ge=0, le=100)


class ReplanConfig(_Frozen):
    """Re-planning a cascade live on workload shift (Cascadia §4.4, footnote 5; gateway.cascade.replanner):
    windows of `window_s`, `sample_size` answered requests' lengths sampled, `shadow_share` of requests run
    through every stage (unbilled) and judged; a shift (p < `alpha`) re-runs Algorithm 1 off the event loop
    and swaps the thresholds. The stages' configured thresholds are the initial plan's, made for `rate_rps`
    on the quality profile's `dataset` subset."""

    gpus: str = Field(min_length=3)  # GPU:COUNT the plan may use, e.g. "h100:32" (as `loadgen cascade-plan`)
    rate_rps: float = Field(gt=0, allow_inf_nan=False)  # the arrival rate the initial plan assumes
    q_min: float | None = Field(None, ge=0, le=100)  # quality floor on the judge's 0-100 scale ...
    l_max_s: float | None = Field(None, gt=0, allow_inf_nan=False)  # ... and/or a latency budget (App. C)
    dataset: Literal["mt-bench", "mt-bench-hard", "mt-bench-easy"] = "mt-bench"
    quality_profile: str | None = Field(None, min_length=1)  # a quality-profile JSON; None = the shipped one
    window_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    sample_size: int = Field(50, ge=2)
    shadow_share: float = Field(0.05, ge=0, le=1)
    alpha: float = Field(0.001, gt=0, lt=1)
    min_shadow: int = Field(20, ge=2)
    judge_latency_s: float = Field(0.27, ge=0, allow_inf_nan=False)  # per judged stage, in the e2e estimate

    @model_validator(mode="after")
    def _complete(self) -> ReplanConfig:
        from switchyard.hardware import GPUS  # noqa: PLC0415

        name, sep, count = self.gpus.partition(":")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ValueError(f"gpus {self.gpus!r}: expected GPU:COUNT like h100:32")
        if name not in GPUS:
            raise ValueError(f"gpus {self.gpus!r}: unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
        if self.q_min is None and self.l_max_s is None:
            raise ValueError("a re-plan needs q_min (a quality floor), l_max_s (a latency budget), or both")
        return self

    @property
    def gpu(self) -> tuple[str, int]:
        name, _, count = self.gpus.partition(":")
        return name, int(count)


class CascadeConfig(_Frozen):
    """A cascade served as a model (Cascadia Fig. 4): stage 1 answers, the judge scores, below the stage's
    threshold the request escalates to the next stage's model (gateway.cascade)."""

    name: str = Field(min_length=1)
    stages: tuple[CascadeStageConfig, ...]
    judge: JudgeConfig
    on_judge_failure: Literal["escalate", "accept"] = "escalate"
    # "final_live": earlier stages are buffered, the last one streams as it is generated; "buffered": every
    # stage is buffered and the answering one replayed (no byte leaves before the judge has spoken).
    streaming: Literal["final_live", "buffered"] = "final_live"
    # Re-plan the thresholds on workload shift (None: the configured thresholds stay).
    replan: ReplanConfig | None = None

    @model_validator(mode="after")
    def _shape(self) -> CascadeConfig:
        if len(self.stages) < 2:
            raise ValueError(f"cascade {self.name!r} needs at least 2 stages, got {len(self.stages)}")
        for index, stage in enumerate(self.stages[:-1]):
            if stage.threshold is None:
                raise ValueError(f"cascade {self.name!r}: stage {index} ({stage.model}) needs a threshold")
        if self.stages[-1].threshold is not None:
            raise ValueError(f"cascade {self.name!r}: the last stage ({self.stages[-1].model}) always "
                             "answers; it takes no threshold")
        models = [s.model for s in self.stages]
        if len(set(models)) != len(models):
            raise ValueError(f"cascade {self.name!r}: a model appears twice in its stages")
        return self


class GatewayConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0 = any free port (tests)
    policy: PolicyConfig = PolicyConfig()
    engines: tuple[EngineAddress, ...] = ()  # Switchyard engine agents (gRPC)
    # How requests travel to an agent: "session", all on one multiplexed Session call per agent (events of an
    # engine step batched in one message); "per_request", one Generate call each (the pre-Session protocol).
    engine_streams: Literal["session", "per_request"] = "session"
    upstreams: tuple[UpstreamUrl, ...] = ()  # plain OpenAI-compatible servers
    # Pooled connections per upstream: one per in-flight stream (HTTP/1.1); a stream waiting for one fails
    # after the connect timeout. Bounds file descriptors (each stream also holds its client's socket).
    upstream_max_connections: int = Field(4096, ge=1)
    max_body_bytes: int = Field(4 * MIB, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    stale_after_s: float = Field(5.0, gt=0)
    session_ttl_s: float = Field(600.0, gt=0)
    max_dispatch_attempts: int = Field(3, ge=1, le=16)
    # An attempt that produced no event for this long is a stall: retried elsewhere before the first event,
    # an error event after it, and a failure for outlier detection. Above any legitimate gap (a queued
    # request's wait for its prefill); the client-facing bound is client_limits.idle_stream_timeout_s.
    engine_stall_timeout_s: float = Field(60.0, gt=0)
    outlier: OutlierConfig = OutlierConfig()
    admission: AdmissionConfig = AdmissionConfig()
    retry: RetryConfig = RetryConfig()
    slo: SloConfig = SloConfig()
    allow_policy_override: bool = False  # honour the x-switchyard-policy request header
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Processes serving the port (gateway.workers); 1 = this process alone, no supervisor.
    workers: int = Field(1, ge=1)
    # API keys and their limits (gateway.access); None = an open gateway that accepts every request.
    api_keys_file: str | None = Field(None, min_length=1)
    engine_link: EngineLinkConfig = EngineLinkConfig()  # TLS and token towards the agents; default plaintext
    client_limits: ClientLimitsConfig = ClientLimitsConfig()  # slowloris, idle streams, slow readers
    reschedule: RescheduleConfig = RescheduleConfig()
    # Serve /admin/* (gateway.api.admin): with an API key file only admin keys may call them.
    enable_admin: bool = False
    # A `switchyard plan --json` file (CAUCHY): at GET /v1/plan with the fleet's combos; None: no plan.
    plan_file: str | None = Field(None, min_length=1)
    autoscale: AutoscaleConfig = AutoscaleConfig()
    # Cascades served as models (gateway.cascade); a request for a cascade's name runs its stages.
    cascades: tuple[CascadeConfig, ...] = ()

    @model_validator(mode="after")
    def _no_duplicate_backends(self) -> GatewayConfig:
        for name, values in (("engines", self.engines), ("upstreams", self.upstreams)):
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: duplicate entries")
        if self.autoscale.enabled and self.plan_file is None:
            raise ValueError("autoscale needs plan_file (--plan PATH): the deployed combos and candidates")
        if self.autoscale.enabled and self.workers != 1:
            raise ValueError("autoscale runs in a one-process gateway (workers: 1): it counts the arrivals, "
                             "and each worker of several sees only its share")
        if self.policy.name == "length_stages" and self.reschedule.policy != "length_stages":
            raise ValueError("policy length_stages needs reschedule.policy length_stages (--reschedule "
                             "length_stages): the rescheduler publishes the stages it routes by")
        names = [c.name for c in self.cascades]
        if len(set(names)) != len(names):
            raise ValueError("cascades: two cascades share a name")
        stage_models = {s.model for c in self.cascades for s in c.stages}
        for name in names:
            if name in stage_models:
                raise ValueError(f"cascades: {name!r} is both a cascade and a stage model")
        replanned = [c.name for c in self.cascades if c.replan is not None]
        if replanned and self.workers != 1:
            raise ValueError(f"cascades: {', '.join(replanned)} re-plan in a one-process gateway "
                             "(workers: 1): the rate test counts the arrivals, and each worker of several "
                             "sees only its share")
        return self


def format_errors(exc: ValidationError) -> str:
    """A validation error as one line: `path: message; ...`."""
    lines = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a `.json`, `.yaml` or `.yml` file (YAML needs PyYAML)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from e
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # noqa: PLC0415 (optional: only YAML files need it)
        except ImportError as e:
            raise ConfigError(f"{p}: YAML config needs PyYAML; use a .json file instead") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: cannot parse YAML: {e}") from e
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{p}: cannot parse JSON: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


_LIST_FIELDS = frozenset({"engines", "upstreams"})
_JSON_FIELDS = frozenset({"params"})


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Overrides from `SWITCHYARD_GATEWAY_*` variables; `__` nests (`SWITCHYARD_GATEWAY_POLICY__NAME`).

    List fields take comma-separated values; `POLICY__PARAMS` takes a JSON object. Unknown names reach the
    model and are rejected there like an unknown file key.
    """
    out: dict[str, Any] = {}
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in key[len(ENV_PREFIX) :].split("__")]
        raw = environ[key]
        value: Any = raw
        if path[-1] in _LIST_FIELDS:
            value = [v.strip() for v in raw.split(",") if v.strip()]
        elif path[-1] in _JSON_FIELDS:
            try:
                value = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"{key}: not valid JSON: {e}") from e
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`; nested mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(
    *,
    file_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Defaults < file < environment < CLI flags, validated once. Raises `ConfigError` naming bad paths."""
    raw: dict[str, Any] = read_config_file(file_path) if file_path is not None else {}
    if environ is not None:
        raw = deep_merge(raw, env_overrides(environ))
    if cli:
        raw = deep_merge(raw, cli)
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from e


def log_effective_config(config: GatewayConfig, logger: logging.Logger) -> None:
    logger.info("effective config: %s", config.model_dump_json())

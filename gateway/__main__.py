"""Command line of the gateway: `python -m gateway --port 8000 --policy round_robin --engine HOST:PORT ...`.

Owns: flags (only those given override the file and the environment), one-line operator errors (exit 2; 1 when
a worker of a multi-worker gateway dies), logging set-up, and the event loop: uvloop is installed here and
nowhere else. `--workers 1` (the default) runs `gateway.app.serve` in this process; `--workers N` runs the
supervisor (`gateway.workers.supervisor`), whose workers are this same entry code again (`--worker-spec PATH`,
an internal flag), so each worker process installs uvloop here too. `main(argv, prog=...)` is what
`switchyard gateway ...` delegates to.
Must not: wire components (that is `gateway.app`) or manage worker processes (that is the supervisor).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gateway.access.keys import load_key_table
from gateway.app import serve
from gateway.config import ConfigError, GatewayConfig, build_config, load_plan_document
from gateway.engines.grpc_link import load_engine_link
from gateway.workers.spec import read_spec
from gateway.workers.supervisor import WorkerFailed, supervise
from gateway.workers.worker import run_worker


def build_argparser(prog: str = "python -m gateway") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the Switchyard gateway. Precedence: defaults < --config file < SWITCHYARD_GATEWAY_* "
        "environment < flags.",
    )
    p.add_argument("--config", metavar="PATH", help="YAML or JSON file with the config tree")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--policy", help="routing policy name, e.g. round_robin, least_loaded, session_affinity")
    p.add_argument(
        "--policy-param",
        action="append",
        metavar="KEY=VALUE",
        help="policy parameter (VALUE parsed as JSON, else a string); repeatable",
    )
    p.add_argument("--engine", action="append", metavar="HOST:PORT", help="engine agent (gRPC); repeatable")
    p.add_argument(
        "--engine-streams",
        choices=["session", "per_request"],
        help="to agents: one multiplexed Session call per agent (default) or one Generate call per request",
    )
    p.add_argument("--upstream", action="append", metavar="URL", help="OpenAI-compatible server; repeatable")
    link = p.add_argument_group("engine link (gateway -> agents; docs/security.md)")
    link.add_argument(
        "--engine-tls", action="store_true", default=None, help="connect to the agents over TLS"
    )
    link.add_argument("--engine-tls-ca", metavar="FILE", help="PEM CA of the agents' certificates")
    link.add_argument(
        "--engine-tls-cert", metavar="FILE", help="mutual TLS: the gateway's PEM client certificate"
    )
    link.add_argument("--engine-tls-key", metavar="FILE", help="mutual TLS: its PEM private key")
    link.add_argument(
        "--engine-tls-server-name",
        metavar="NAME",
        help="name the agents' certificates carry (default: each host)",
    )
    link.add_argument(
        "--engine-auth-token-file", metavar="FILE", help="file holding the agents' bearer token"
    )
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--drain-timeout-s", type=float)
    p.add_argument("--stale-after-s", type=float)
    p.add_argument("--session-ttl-s", type=float)
    p.add_argument("--max-dispatch-attempts", type=int)
    p.add_argument("--slo-ttft-ms", type=float, help="default TTFT target when a request sends none")
    p.add_argument("--slo-tpot-ms", type=float, help="default TPOT target when a request sends none")
    p.add_argument(
        "--allow-policy-override",
        action="store_true",
        default=None,
        help="honour the x-switchyard-policy request header",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        dest="api_keys_file",
        help="YAML or JSON file of API keys and their limits (docs/security.md); without one the gateway "
        "accepts every request",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="worker processes serving the port (SO_REUSEPORT), each with its own event loop; default 1",
    )
    p.add_argument(
        "--reschedule",
        choices=["none", "star", "star-nopred", "length_stages"],
        help="move running requests between engines: STAR with length predictions, STAR on current load, "
        "CascadeInfer's length stages (with --policy length_stages), or none (default)",
    )
    p.add_argument(
        "--reschedule-param",
        action="append",
        metavar="KEY=VALUE",
        help="rescheduler parameter (STAR: theta=0.1, horizon=32; length_stages: layout=dp, refine=qoe, "
        "balance=bidask, plan=PATH, ...); repeatable",
    )
    p.add_argument(
        "--enable-admin",
        action="store_true",
        default=None,
        help="serve /admin/* (POST /admin/migrate); with --api-keys only admin keys may call them",
    )
    p.add_argument(
        "--plan",
        metavar="PATH",
        dest="plan_file",
        help="a `switchyard plan --json` file (CAUCHY): served at GET /v1/plan next to the fleet's combos",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        default=None,
        help="run CAUCHY's combo autoscaler on the measured QPS (needs --plan): decisions at GET /v1/plan "
        "(`switchyard up --plan --autoscale` applies them too)",
    )
    p.add_argument(
        "--autoscale-param",
        action="append",
        metavar="KEY=VALUE",
        help="autoscaler parameter: step_s, ratio, local_window_s, global_window_s, provisioning_s, grace_s; "
        "repeatable",
    )
    p.add_argument("--worker-spec", metavar="PATH", help=argparse.SUPPRESS)  # a supervisor's worker
    return p


def key_values(items: Sequence[str], what: str = "policy.params") -> dict[str, Any]:
    """KEY=VALUE flags as a mapping; a VALUE that parses as JSON is that value, else the string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what}: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the given flags set (absent flags leave file/env values alone)."""
    out: dict[str, Any] = {}
    simple = (
        "host",
        "port",
        "max_body_bytes",
        "request_timeout_s",
        "drain_timeout_s",
        "stale_after_s",
        "session_ttl_s",
        "max_dispatch_attempts",
        "allow_policy_override",
        "log_level",
        "workers",
        "engine_streams",
        "api_keys_file",
        "enable_admin",
        "plan_file",
    )
    for name in simple:
        value = getattr(args, name)
        if value is not None:
            out[name] = value
    if args.engine:
        out["engines"] = args.engine
    if args.upstream:
        out["upstreams"] = args.upstream
    policy: dict[str, Any] = {}
    if args.policy is not None:
        policy["name"] = args.policy
    if args.policy_param:
        policy["params"] = key_values(args.policy_param)
    if policy:
        out["policy"] = policy
    reschedule: dict[str, Any] = {}
    if args.reschedule is not None:
        reschedule["policy"] = args.reschedule
    if args.reschedule_param:
        reschedule["params"] = key_values(args.reschedule_param, what="reschedule.params")
    if reschedule:
        out["reschedule"] = reschedule
    autoscale: dict[str, Any] = {}
    if args.autoscale is not None:
        autoscale["enabled"] = args.autoscale
    if args.autoscale_param:
        autoscale |= key_values(args.autoscale_param, what="autoscale")
    if autoscale:
        out["autoscale"] = autoscale
    slo = {k: v for k, v in (("ttft_ms", args.slo_ttft_ms), ("tpot_ms", args.slo_tpot_ms)) if v is not None}
    if slo:
        out["slo"] = slo
    link_flags = (
        ("tls", args.engine_tls),
        ("tls_ca_file", args.engine_tls_ca),
        ("tls_cert_file", args.engine_tls_cert),
        ("tls_key_file", args.engine_tls_key),
        ("tls_server_name", args.engine_tls_server_name),
        ("auth_token_file", args.engine_auth_token_file),
    )
    link = {k: v for k, v in link_flags if v is not None}
    if link:
        out["engine_link"] = link
    return out


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 (installed in __main__ only, by the style guide)
    except ImportError:
        return None
    return uvloop.new_event_loop


def configure_logging(config: GatewayConfig, *, worker: int | None = None) -> None:
    tag = "" if worker is None else f"[worker {worker}] "
    logging.basicConfig(
        level=config.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s",
    )


def _worker_main(spec_path: str) -> int:
    spec = read_spec(spec_path)
    configure_logging(spec.config, worker=spec.index)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(run_worker(spec))
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m gateway") -> int:
    args = build_argparser(prog).parse_args(argv)
    try:
        if args.worker_spec is not None:
            return _worker_main(args.worker_spec)
        config = build_config(file_path=args.config, environ=os.environ, cli=cli_overrides(args))
        if not config.engines and not config.upstreams:
            raise ConfigError(
                "no engines: pass --engine HOST:PORT or --upstream URL (or set them in --config)"
            )
        if config.api_keys_file is not None:  # read again by each app; checked here before any worker starts
            load_key_table(config.api_keys_file)
        if config.plan_file is not None:  # likewise
            load_plan_document(config.plan_file)
        if config.engines:  # the link's files, read again by each app; checked before any worker starts
            load_engine_link(config.engine_link)
        configure_logging(config)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(config) if config.workers == 1 else supervise(config))
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except WorkerFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

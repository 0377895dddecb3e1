"""The `switchyard` console command.

  switchyard up [--port 8000] [--engines 4] [--profile P ...] [--policy round_robin] [--base-agent-port 50051]
      N simulated engine agents as child processes (profiles cycled: a heterogeneous fleet when several are
      given), the gateway in this process, a copy-pastable curl and OpenAI SDK example; Ctrl-C/SIGTERM stops
      the gateway (draining) and then every child (terminated and reaped).
  switchyard gateway ...   delegates to `gateway.__main__.main`
  switchyard agent ...     delegates to `engine_agent.__main__.main`

Owns: sub-command dispatch, the `up` orchestration and its banner, one-line errors (exit 2 for usage, 1 for a
fleet that failed to start).
Must not: wire the gateway (gateway.app does) or implement agents; uvloop is installed by `gateway.__main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
from collections.abc import Sequence

import orjson

from gateway.__main__ import configure_logging, loop_factory
from gateway.__main__ import main as gateway_main
from gateway.app import serve
from gateway.config import ConfigError, GatewayConfig, PolicyConfig
from gateway.engines.grpc_client import GrpcEngineClient
from switchyard.local_fleet import AgentSpec, FleetError, LocalFleet, plan_agents

DEFAULT_PROFILE = "h100-llama3-8b"
USAGE = """usage: switchyard {up,gateway,agent} ...

  up        start simulated engine agents and a gateway in front of them
  gateway   run the gateway (see: switchyard gateway --help)
  agent     run one engine agent (see: switchyard agent --help)
"""


def build_up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard up", description="A local simulated fleet behind a gateway.")
    p.add_argument("--host", default="127.0.0.1", help="gateway and agents bind here")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--engines", type=int, default=4, help="number of simulated engine agents")
    p.add_argument(
        "--profile",
        action="append",
        metavar="PROFILE",
        help=f"sim profile (repeatable: cycled over the engines); default {DEFAULT_PROFILE}",
    )
    p.add_argument("--policy", default="round_robin", help="routing policy")
    p.add_argument("--base-agent-port", type=int, default=50051, help="agent i listens on this + i")
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="how long shutdown waits for streams")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def banner(base_url: str, specs: Sequence[AgentSpec], models: Sequence[str], policy: str) -> str:
    model = models[0]
    api = f"{base_url}/v1"
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "stream": True})
    curl = (
        f"curl -N {api}/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body.decode())}"
    )
    sdk = (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{api}", api_key="unused")\n'
        f'reply = client.chat.completions.create(model="{model}", '
        'messages=[{"role": "user", "content": "Hello!"}])\n'
        "print(reply.choices[0].message.content)"
    )
    fleet = ", ".join(f"{s.engine_id}={s.profile}@{s.address}" for s in specs)
    return "\n".join(
        [
            f"Switchyard is up: {len(specs)} simulated engine(s) [{fleet}], policy {policy}",
            f"  base URL: {api}    models: {', '.join(models)}",
            "",
            "  curl:",
            f"    {curl}",
            "",
            "  OpenAI SDK (Python):",
            *("    " + line for line in sdk.splitlines()),
            "",
            "Press Ctrl-C to stop.",
        ]
    )


async def _served_models(specs: Sequence[AgentSpec]) -> list[str]:
    models: list[str] = []
    for spec in specs:
        client = GrpcEngineClient(spec.address)
        try:
            model = (await client.describe()).model
        finally:
            await client.close()
        if model not in models:
            models.append(model)
    return models


async def _up(args: argparse.Namespace, specs: list[AgentSpec]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    fleet = LocalFleet(specs)
    try:
        starting = asyncio.create_task(fleet.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        stopping.cancel()
        starting.result()
        models = await _served_models(specs)
        config = GatewayConfig(
            host=args.host,
            port=args.port,
            policy=PolicyConfig(name=args.policy),
            engines=tuple(s.address for s in specs),
            drain_timeout_s=args.drain_timeout_s,
            log_level=args.log_level,
        )

        def announce(base_url: str) -> None:
            print(banner(base_url, specs, models, args.policy), flush=True)

        await serve(config, stop=stop, on_listening=announce, handle_signals=False)
        return 0
    finally:
        await fleet.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def up(argv: Sequence[str]) -> int:
    parser = build_up_parser()
    args = parser.parse_args(argv)
    from engine_agent.sim.profiles import known_profiles  # noqa: PLC0415 (only `up` needs the agent package)
    from gateway.policies.registry import POLICY_NAMES  # noqa: PLC0415

    profiles = args.profile or [DEFAULT_PROFILE]
    unknown = [p for p in profiles if p not in known_profiles()]
    if unknown:
        parser.error(f"unknown profile {unknown[0]!r}; known: {', '.join(known_profiles())}")
    if args.policy not in POLICY_NAMES:
        parser.error(f"unknown policy {args.policy!r}; known: {', '.join(POLICY_NAMES)}")
    try:
        specs = plan_agents(args.engines, profiles, args.base_agent_port, args.host)
    except ValueError as e:
        parser.error(str(e))
    configure_logging(GatewayConfig(log_level=args.log_level))
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(_up(args, specs))
    except FleetError as e:
        print(f"switchyard up: error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"switchyard up: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "up":
        return up(rest)
    if command == "gateway":
        return gateway_main(rest, prog="switchyard gateway")
    if command == "agent":
        from engine_agent.__main__ import main as agent_main  # noqa: PLC0415 (agent code only when asked)

        return agent_main(rest, prog="switchyard agent")
    print(f"switchyard: error: unknown command {command!r} (choose from up, gateway, agent)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

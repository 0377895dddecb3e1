"""Command line of the engine agent.

Usage: `python -m engine_agent --backend sim --profile h100-llama3-8b --port 50051`.

Owns: argument parsing into an `AgentConfig`, one-line operator errors (exit 2) for a bad config, an unknown
profile or a taken port, logging set-up, and the event loop (uvloop where installed: the only place that
installs it).
`build_agent_argparser` and `main(argv)` are what `switchyard agent ...` delegates to.
Must not: wire components (that is `engine_agent.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from engine_agent.config import AgentConfig
from engine_agent.server import AgentStartupError, serve
from engine_agent.sim.profiles import UnknownProfileError, get_profile, known_profiles


def build_agent_argparser(prog: str = "python -m engine_agent") -> argparse.ArgumentParser:
    defaults = AgentConfig()
    parser = argparse.ArgumentParser(
        prog=prog, description="Run one Switchyard engine agent (one GPU or TP group)."
    )
    parser.add_argument("--backend", choices=["sim"], default=defaults.backend)
    parser.add_argument("--profile", default=defaults.profile, help="sim profile, e.g. h100-llama3-8b")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port, help="0 = any free port")
    parser.add_argument("--engine-id", default=None, help="default: <backend>-<port>")
    parser.add_argument("--state-interval-ms", type=int, default=defaults.state_interval_ms)
    parser.add_argument("--drain-grace-s", type=float, default=defaults.drain_grace_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--role", default=defaults.role, help='e.g. "prefill", "decode", "cascade-small"')
    parser.add_argument("--model", default=None, help="reported model name (default: the profile's model)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    return AgentConfig(
        host=args.host,
        port=args.port,
        engine_id=args.engine_id or f"{args.backend}-{args.port}",
        backend=args.backend,
        profile=args.profile,
        state_interval_ms=args.state_interval_ms,
        drain_grace_s=args.drain_grace_s,
        seed=args.seed,
        role=args.role,
        model=args.model,
    )


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m engine_agent") -> int:
    args = build_agent_argparser(prog).parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"{prog}: error: invalid config: {where}: {first['msg']}", file=sys.stderr)
        return 2
    try:
        get_profile(config.profile)
    except UnknownProfileError:
        print(
            f"{prog}: error: unknown profile {config.profile!r}; "
            f"known profiles: {', '.join(known_profiles())}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(serve(config))
    except AgentStartupError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

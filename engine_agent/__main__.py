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
from pathlib import Path

from pydantic import ValidationError

from engine_agent.config import AgentConfig, VllmConfig
from engine_agent.server import AgentStartupError, serve
from engine_agent.sim.profiles import UnknownProfileError, get_profile, known_profiles


def build_agent_argparser(prog: str = "python -m engine_agent") -> argparse.ArgumentParser:
    defaults = AgentConfig()
    parser = argparse.ArgumentParser(
        prog=prog, description="Run one Switchyard engine agent (one GPU or TP group)."
    )
    parser.add_argument("--backend", choices=["sim", "vllm"], default=defaults.backend)
    parser.add_argument("--profile", default=defaults.profile, help="sim profile, e.g. h100-llama3-8b")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port, help="0 = any free port")
    parser.add_argument("--engine-id", default=None, help="default: <backend>-<port>")
    parser.add_argument(
        "--state-interval-ms",
        type=int,
        default=round(defaults.state_interval_s * 1000),
        help="WatchState push interval when the watcher asks for none",
    )
    parser.add_argument("--drain-grace-s", type=float, default=defaults.drain_grace_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--role", default=defaults.role, help='e.g. "prefill", "decode", "cascade-small"')
    parser.add_argument(
        "--model",
        default=None,
        help="sim: the reported model name (default: the profile's model); "
        "vllm: the Hugging Face model directory to serve",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="vllm: the model name clients use (default: the directory name)",
    )
    parser.add_argument(
        "--hidden-state-interval",
        type=int,
        default=defaults.hidden_state_interval or 0,
        help="decode steps between hidden-state taps (0 = off)",
    )
    parser.add_argument(
        "--lens", action="store_true", help="LENS plans each iteration's token budget (Algorithm 1)"
    )
    sim = parser.add_argument_group("sim backend")
    sim.add_argument("--sim-kv-transfer-gbps", type=float, default=defaults.sim_kv_transfer_gbps)
    sim.add_argument("--sim-kv-transfer-latency-s", type=float, default=defaults.sim_kv_transfer_latency_s)
    v = parser.add_argument_group("vllm backend")
    vd = defaults.vllm
    v.add_argument("--max-model-len", type=int, default=vd.max_model_len)
    v.add_argument("--max-num-seqs", type=int, default=vd.max_num_seqs)
    v.add_argument("--max-num-batched-tokens", type=int, default=vd.max_num_batched_tokens)
    v.add_argument("--block-size", type=int, default=vd.block_size, help="CPU: a multiple of 32")
    v.add_argument("--dtype", default=vd.dtype)
    v.add_argument("--gpu-memory-utilization", type=float, default=vd.gpu_memory_utilization)
    v.add_argument("--cpu-kv-cache-gb", type=float, default=vd.cpu_kv_cache_gb)
    v.add_argument("--tensor-parallel-size", type=int, default=vd.tensor_parallel_size)
    v.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile")
    v.add_argument("--no-migration", action="store_true", help="no NIXL KV connector (MigrateOut/In refused)")
    v.add_argument("--nixl-host", default=vd.nixl_side_channel_host, help="address peers reach NIXL on")
    v.add_argument(
        "--nixl-port", type=int, default=None, help="NIXL side channel (default: agent port + 1000)"
    )
    v.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="run NIXL's UCX progress thread (it polls without sleeping: one core busy even when idle)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    vllm = args.backend == "vllm"
    return AgentConfig(
        model_dir=args.model if vllm else None,
        vllm=VllmConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            enable_migration=not args.no_migration,
            nixl_side_channel_host=args.nixl_host,
            nixl_side_channel_port=args.nixl_port,
            nixl_progress_thread=args.nixl_progress_thread,
        ),
        hidden_state_interval=args.hidden_state_interval or None,  # the flag's 0 = off
        lens_planning=args.lens,
        sim_kv_transfer_gbps=args.sim_kv_transfer_gbps,
        sim_kv_transfer_latency_s=args.sim_kv_transfer_latency_s,
        host=args.host,
        port=args.port,
        engine_id=args.engine_id or f"{args.backend}-{args.port}",
        backend=args.backend,
        profile=args.profile,
        state_interval_s=args.state_interval_ms / 1000.0,
        drain_grace_s=args.drain_grace_s,
        seed=args.seed,
        role=args.role,
        model=args.served_model_name if vllm else args.model,
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
    if config.backend == "vllm":
        if config.model_dir is None:
            print(
                f"{prog}: error: --backend vllm needs --model DIR (a Hugging Face model directory)",
                file=sys.stderr,
            )
            return 2
        if not (Path(config.model_dir) / "config.json").is_file():
            print(
                f"{prog}: error: {config.model_dir} is not a model directory (no config.json)",
                file=sys.stderr,
            )
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

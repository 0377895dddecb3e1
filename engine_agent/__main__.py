"""Command line of the engine agent.

Usage: `python -m engine_agent --backend sim --profile h100-llama3-8b --port 50051`.

Owns: argument parsing into an `AgentConfig`, the environment variables that stand in for the link security
flags (`LINK_ENV`, applied in `link_from_args` only: compose files pass secrets' paths this way), one-line
operator errors (exit 2) for a bad config, an unknown profile, a taken port or an unreadable TLS / token file,
logging set-up, and the event loop (uvloop where installed: the only place that
installs it).
`build_agent_argparser` and `main(argv)` are what `switchyard agent ...` delegates to.
Must not: wire components (that is `engine_agent.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import ValidationError
from threadpoolctl import threadpool_limits

from engine_agent.config import AgentConfig, LinkSecurityConfig, VllmConfig
from engine_agent.server import AgentStartupError, serve
from switchyard.profiles import UnknownProfileError, get_profile, known_profiles

# Link security flag (its argparse dest) -> the environment variable used when the flag is not given.
LINK_ENV: dict[str, str] = {
    "tls_cert": "SWITCHYARD_AGENT_TLS_CERT",
    "tls_key": "SWITCHYARD_AGENT_TLS_KEY",
    "tls_client_ca": "SWITCHYARD_AGENT_TLS_CLIENT_CA",
    "auth_token_file": "SWITCHYARD_AGENT_AUTH_TOKEN_FILE",
}


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
    parser.add_argument("--combo", default=defaults.combo,
                        help='the GPU combo this engine belongs to, e.g. "1xh800+2xh20" (switchyard plan)')
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
        "--record-hidden-states",
        metavar="DIR",
        default=None,
        help="write the tap's samples, labelled with each completed request's remaining length, as .npz "
        "shards into DIR (STAR's predictor training data; `switchyard predictor train`)",
    )
    parser.add_argument(
        "--length-predictor",
        metavar="FILE|oracle",
        default=None,
        help="STAR: predict each running request's remaining length from the tap with this predictor file "
        "(`switchyard predictor train`), or `oracle` (sim only: the exact lengths), and send the predictions "
        "and the engine's future load every tap (for the gateway's --reschedule star)",
    )
    parser.add_argument(
        "--star-report",
        action="store_true",
        help="STAR without a predictor: send each running request's current length every k engine iterations "
        "(for the gateway's --reschedule star-nopred; implied by --length-predictor)",
    )
    parser.add_argument(
        "--lens", action="store_true", help="LENS plans each iteration's token budget (Algorithm 1)"
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=defaults.blas_threads,
        help="BLAS threads for the agent's own numpy work (LENS refits, the length predictor)",
    )
    sim = parser.add_argument_group("sim backend")
    sim.add_argument("--sim-kv-link-gbps", type=float, default=defaults.sim_kv_link_gbps,
                     help="modelled KV link between agents in Gbit/s (migrations)")
    sim.add_argument("--sim-kv-transfer-latency-s", type=float, default=defaults.sim_kv_transfer_latency_s)
    sim.add_argument(
        "--sim-max-num-seqs",
        type=int,
        default=None,
        help="the simulated engine's batch sequence cap (default: the profile's)",
    )
    v = parser.add_argument_group("vllm backend")
    vd = defaults.vllm
    v.add_argument("--max-model-len", type=int, default=vd.max_model_len)
    v.add_argument("--max-num-seqs", type=int, default=vd.max_num_seqs)
    v.add_argument("--max-num-batched-tokens", type=int, default=vd.max_num_batched_tokens)
    v.add_argument("--block-size", type=int, default=vd.block_size, help="CPU: a multiple of 32")
    v.add_argument("--dtype", default=vd.dtype)
    v.add_argument("--gpu-memory-utilization", type=float, default=vd.gpu_memory_utilization)
    v.add_argument("--cpu-kv-cache-gb", type=float, default=vd.cpu_kv_cache_gb)
    v.add_argument("--cpu-omp-threads-bind", default=vd.cpu_omp_threads_bind, metavar="CORES",
                   help="CPU platform: cores for torch's OpenMP threads, e.g. '0-2' (default: all but "
                        "the last when migration is on, else vLLM's choice)")
    v.add_argument("--tensor-parallel-size", type=int, default=vd.tensor_parallel_size)
    v.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile")
    v.add_argument("--no-migration", action="store_true", help="no NIXL KV connector (MigrateOut/In refused)")
    v.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM without prefix caching (and so without KV events for the gateway's index)")
    v.add_argument(
        "--migration-kv-lease-s",
        type=float,
        default=vd.migration_kv_lease_s,
        help="how long a cut request's KV is held for its target to pull (the sim frees it at the cut)",
    )
    v.add_argument("--nixl-host", default=vd.nixl_side_channel_host, help="address peers reach NIXL on")
    v.add_argument(
        "--nixl-port", type=int, default=None, help="NIXL side channel (default: agent port + 1000)"
    )
    v.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="run NIXL's UCX progress thread (it polls without sleeping: one core busy even when idle)",
    )
    link = parser.add_argument_group(
        "gateway link security (docs/security.md)",
        "Who may call this agent. Each flag falls back to its environment variable; none given = open.",
    )
    link.add_argument(
        "--tls-cert", metavar="FILE", help=f"serve TLS with this PEM certificate [{LINK_ENV['tls_cert']}]"
    )
    link.add_argument("--tls-key", metavar="FILE", help=f"its PEM private key [{LINK_ENV['tls_key']}]")
    link.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help=f"mutual TLS: callers need a certificate signed by this PEM CA [{LINK_ENV['tls_client_ca']}]",
    )
    link.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="every RPC but grpc.health.v1 Check needs `authorization: Bearer <token>`, the token being this "
        f"file's content (whitespace stripped) [{LINK_ENV['auth_token_file']}]",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def link_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> LinkSecurityConfig:
    """The link security flags, each falling back to its `LINK_ENV` variable (an empty variable = unset)."""
    given = {dest: getattr(args, dest, None) or environ.get(var) or None for dest, var in LINK_ENV.items()}
    return LinkSecurityConfig(
        tls_cert_file=given["tls_cert"],
        tls_key_file=given["tls_key"],
        tls_client_ca_file=given["tls_client_ca"],
        auth_token_file=given["auth_token_file"],
    )


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AgentConfig:
    vllm = args.backend == "vllm"
    return AgentConfig(
        link=link_from_args(args, os.environ if environ is None else environ),
        model_dir=args.model if vllm else None,
        vllm=VllmConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
            cpu_omp_threads_bind=args.cpu_omp_threads_bind,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            enable_migration=not args.no_migration,
            enable_prefix_caching=not args.no_prefix_caching,
            nixl_side_channel_host=args.nixl_host,
            nixl_side_channel_port=args.nixl_port,
            nixl_progress_thread=args.nixl_progress_thread,
            migration_kv_lease_s=args.migration_kv_lease_s,
        ),
        hidden_state_interval=args.hidden_state_interval or None,  # the flag's 0 = off
        record_hidden_states=args.record_hidden_states,
        length_predictor=args.length_predictor,
        star_report=args.star_report,
        lens_planning=args.lens,
        blas_threads=args.blas_threads,
        sim_kv_link_gbps=args.sim_kv_link_gbps,
        sim_kv_transfer_latency_s=args.sim_kv_transfer_latency_s,
        sim_max_num_seqs=args.sim_max_num_seqs,
        host=args.host,
        port=args.port,
        engine_id=args.engine_id or f"{args.backend}-{args.port}",
        backend=args.backend,
        profile=args.profile,
        state_interval_s=args.state_interval_ms / 1000.0,
        drain_grace_s=args.drain_grace_s,
        seed=args.seed,
        role=args.role,
        combo=args.combo,
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
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"{loc}: " if loc else ""  # the link settings are checked on their own: no path
        msg = first["msg"].removeprefix("Value error, ")
        print(f"{prog}: error: invalid config: {where}{msg}", file=sys.stderr)
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
    # The agent's numpy work (LENS refits, the STAR predictor) is small; OpenBLAS's default pool (one
    # spinning worker per core) would take cores from the engine it serves. vLLM's processes are spawned
    # with their own pools; this limits only this process's.
    threadpool_limits(limits=config.blas_threads, user_api="blas")
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(serve(config))
    except AgentStartupError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

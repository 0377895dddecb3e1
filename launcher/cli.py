"""The `switchyard` console command.

  switchyard up [--port 8000] [--engines 4] [--profile P ...] [--policy round_robin] [--base-agent-port 50051]
                [--gateway-workers 1]
  switchyard up --backend vllm --model DIR [--engines 1] [--startup-timeout-s 300] ...
      N engine agents as child processes: simulated (profiles cycled: a heterogeneous fleet when several are
      given) or real vLLM serving the model directory DIR (one per machine by default on a CPU), the gateway
      in this process (with --gateway-workers N > 1: this process supervises N gateway worker processes on
      the port, `gateway.workers.supervisor`), a copy-pastable curl and OpenAI SDK example; Ctrl-C/SIGTERM
      stops the gateway (draining) and then every child (terminated and reaped).
  switchyard tiny-model --out DIR [--hidden-size 128 --layers 2 --heads 4 --kv-heads 2 --seed 0 ...] [--force]
      writes a tiny random-weight Llama model (with the repository's tokenizer) that vLLM can serve on a CPU.
  switchyard gateway ...   delegates to `gateway.__main__.main`
  switchyard agent ...     delegates to `engine_agent.__main__.main`
  switchyard predictor collect|train|eval ...   delegates to `engine_agent.star.cli.main` (STAR's predictor),
      with loadgen's dataset loading for `collect`
  switchyard gpus [--price GPU=USD ...] [--json]   the GPU catalogue with CAUCHY Table 1's derived columns
  switchyard plan --model M --workload ... --slo ... [--goodput-rps R] [--budget-usd-h X] ...   CAUCHY's
      combo allocation
  switchyard profile-combos --model M --workload DATASET --slo ...   goodput per combo, measured in the
      simulator, for `plan --goodput-table` (all three in `launcher.planning_cli`)
  switchyard plan-stages --instances E --max-len L (--dataset D | --requests PATH) ...   CascadeInfer's
      length stages (`launcher.stages_cli`)

Owns: sub-command dispatch, the `up` orchestration and its banner, one-line errors (exit 2 for usage, 1 for a
fleet that failed to start).
Must not: wire the gateway (gateway.app does), implement agents or build models (engine_agent.tiny_model
does); uvloop is installed by `gateway.__main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from pydantic import ValidationError

from gateway.__main__ import configure_logging, key_values, loop_factory
from gateway.__main__ import main as gateway_main
from gateway.app import build_app, serve
from gateway.config import (
    AutoscaleConfig,
    ConfigError,
    GatewayConfig,
    PolicyConfig,
    RescheduleConfig,
    format_errors,
)
from gateway.engines.grpc_client import GrpcEngineClient
from gateway.workers.supervisor import WorkerFailed, supervise
from launcher.cascade_up import JudgeStub, add_cascade_flags, cascade_configs, check_cascade_args
from launcher.local_fleet import (
    BACKENDS,
    DEFAULT_START_TIMEOUT_S,
    AgentSpec,
    Backend,
    FleetError,
    LocalActuator,
    LocalFleet,
    plan_agents,
)

DEFAULT_PROFILE = "h100-llama3-8b"
# Engines per backend when --engines is not given: vLLM on a CPU uses every core, so one per machine.
DEFAULT_ENGINES: dict[Backend, int] = {"sim": 4, "vllm": 1}
USAGE = """usage: switchyard {up,tiny-model,gateway,agent,predictor,gpus,plan,profile-combos,plan-stages} ...

  up          start engine agents (simulated, or vLLM with --backend vllm --model DIR) and a gateway
  tiny-model  write a tiny random-weight Llama model directory that vLLM can serve on a CPU
  gateway     run the gateway (see: switchyard gateway --help)
  agent       run one engine agent (see: switchyard agent --help)
  predictor   STAR's remaining-length predictor: collect hidden states, train, eval (see: --help)
  gpus        the GPU catalogue: datasheet figures, prices and CAUCHY Table 1's derived columns
  plan        CAUCHY's GPU-combo allocation for a model, workload, SLO and goodput or budget (see: --help)
  profile-combos  each GPU combo's goodput at an SLO, measured in the simulator (plan --goodput-table)
  plan-stages  CascadeInfer's length-aware stage partition of E instances for a workload (see: --help)
"""


def build_up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="switchyard up", description="A local fleet of engines behind a gateway."
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway and agents bind here")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--backend", choices=BACKENDS, default="sim", help="engine backend of every agent")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model directory (with config.json) the vllm engines serve; required with --backend vllm",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=None,
        help="number of engine agents "
        f"(default: {DEFAULT_ENGINES['sim']} sim, {DEFAULT_ENGINES['vllm']} vllm)",
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="PROFILE",
        help=f"sim profile (repeatable: cycled over the engines); default {DEFAULT_PROFILE}",
    )
    p.add_argument("--policy", default=None,
                   help="routing policy (default round_robin; under --plan goodput_rr with its goodput)")
    p.add_argument(
        "--plan",
        metavar="PATH",
        help="a `switchyard plan --json` file: one sim agent per engine of its combos (labelled --combo "
        "C#k), the gateway serving it at GET /v1/plan and routing by goodput_rr with its goodput",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="with --plan: the gateway runs CAUCHY's combo autoscaler on the measured QPS and this command "
        "applies it, starting a scale-out's copies as new sim agents and draining a scale-in's",
    )
    p.add_argument(
        "--autoscale-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="autoscaler parameter (step_s, ratio, local_window_s, global_window_s, provisioning_s, "
        "grace_s); repeatable",
    )
    p.add_argument("--base-agent-port", type=int, default=50051, help="agent i listens on this + i")
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=None,
        help="how long each agent may take to serve (default "
        f"{DEFAULT_START_TIMEOUT_S['sim']:g} s sim, {DEFAULT_START_TIMEOUT_S['vllm']:g} s vllm)",
    )
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="how long shutdown waits for streams")
    p.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway worker processes serving the port (default 1: the gateway runs in this process)",
    )
    p.add_argument(
        "--reschedule",
        choices=["none", "star", "star-nopred", "length_stages"],
        default="none",
        help="move running requests between engines: STAR (docs/star.md) or CascadeInfer's length stages "
        "(with --policy length_stages; docs/cascadeinfer.md); the agents then push prediction rounds "
        "(--length-predictor for star, current lengths only for star-nopred and length_stages)",
    )
    p.add_argument(
        "--length-predictor",
        metavar="FILE|oracle",
        help="with --reschedule star: the agents' remaining-length predictor (default for sim: oracle, the "
        "simulated engine's exact lengths; vllm needs a FILE from `switchyard predictor train`)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_cascade_flags(p)
    return p


# Under --autoscale a released agent drains this long at most: its requests finish (a scale-in loses none).
AUTOSCALE_DRAIN_S = 600.0


def star_agent_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The agent flags `--reschedule` needs: prediction rounds (`star`) or current lengths (`star-nopred`,
    `length_stages`)."""
    if args.reschedule == "star":
        return ("--length-predictor", args.length_predictor)
    if args.reschedule in ("star-nopred", "length_stages"):
        return ("--star-report",)
    return ()


def check_up_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Backend-dependent rules and defaults (`parser.error` exits 2 with one line). Fills in `engines`,
    `startup_timeout_s`, `policy` and, for vllm, `model` as an absolute path (agents may run from another
    directory); under --plan, `plan_specs` (`plan_engine_specs`) and `engines` from the plan."""
    backend: Backend = args.backend
    args.plan_specs = None
    args.autoscale_config = None
    if backend == "vllm":
        if not args.model:
            parser.error(
                "--backend vllm needs --model DIR (a model directory, e.g. from `switchyard tiny-model`)"
            )
        if args.profile:
            parser.error("--profile is for --backend sim (vllm engines serve --model)")
        model_dir = Path(args.model).expanduser()
        if not model_dir.is_dir():
            parser.error(f"--model {args.model}: no such directory")
        if not (model_dir / "config.json").is_file():
            parser.error(f"--model {args.model}: no config.json in it (not a model directory)")
        args.model = str(model_dir.resolve())
    elif args.model is not None:
        parser.error("--model is for --backend vllm (sim engines serve their --profile's model)")
    if args.plan is not None:
        if backend != "sim":
            parser.error("--plan starts sim agents (the simulated GPUs of its combos); drop --backend vllm")
        if args.engines is not None or args.profile:
            parser.error("--plan sets the engines: drop --engines and --profile")
        try:
            args.plan_specs = plan_engine_specs(args.plan)
        except (OSError, ValueError) as e:
            parser.error(f"--plan {args.plan}: {str(e).splitlines()[0]}")
        args.engines = len(args.plan_specs)
    if args.autoscale_param and not args.autoscale:
        parser.error("--autoscale-param is for --autoscale")
    if args.autoscale:
        if args.plan is None:
            parser.error("--autoscale needs --plan PATH (what is deployed, and what to re-plan over)")
        if args.gateway_workers != 1:
            parser.error("--autoscale runs a one-process gateway: drop --gateway-workers")
        try:
            args.autoscale_config = AutoscaleConfig(
                enabled=True, **key_values(args.autoscale_param, what="--autoscale-param"))
        except ValidationError as e:
            parser.error(f"--autoscale-param: {format_errors(e)}")
        except ConfigError as e:
            parser.error(f"--autoscale-param: {e}")
    if args.engines is None:
        args.engines = DEFAULT_ENGINES[backend]
    if args.policy is None:
        args.policy = "goodput_rr" if args.plan is not None else "round_robin"
    if args.startup_timeout_s is None:
        args.startup_timeout_s = DEFAULT_START_TIMEOUT_S[backend]
    elif args.startup_timeout_s <= 0:
        parser.error("--startup-timeout-s must be positive")
    if args.gateway_workers < 1:
        parser.error("--gateway-workers must be at least 1")
    if args.length_predictor is not None and args.reschedule != "star":
        parser.error("--length-predictor is for --reschedule star")
    if args.reschedule == "star" and args.length_predictor is None:
        if backend == "vllm":
            parser.error("--reschedule star on vllm needs --length-predictor FILE (from predictor train)")
        args.length_predictor = "oracle"
    if args.length_predictor == "oracle" and backend == "vllm":
        parser.error("--length-predictor oracle is for the sim backend (its engines know their lengths)")
    check_cascade_args(parser, args)


class PlanEngine(NamedTuple):
    """One engine of a plan file's combos, as `switchyard up --plan` starts it."""

    profile: str  # the sim profile
    combo: str  # the copy's label, "C#k"
    goodput_rps: float  # the combo's planned goodput per copy
    role: str  # prefill / decode in a disaggregated combo (`switchyard.roles`), else ""


def plan_engine_specs(path: str) -> list[PlanEngine]:
    """Each engine of a plan file's combos (`loadgen.simulate.scaling.plan_engines`: the simulator's
    mapping); ValueError or OSError when it cannot be read."""
    from gateway.planning.plan_file import parse_plan  # noqa: PLC0415
    from gateway.policies.goodput_rr import combo_type  # noqa: PLC0415
    from loadgen.simulate.scaling import plan_engines  # noqa: PLC0415
    from loadgen.simulate.spec import Scaling  # noqa: PLC0415

    plan = parse_plan(orjson.loads(Path(path).read_bytes()))
    return [PlanEngine(spec.profile, spec.combo, plan.goodput_rps.get(combo_type(spec.combo), 0.0), spec.role)
            for spec in plan_engines(Scaling(plan))]


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
    fleet = ", ".join(f"{s.engine_id}={s.label}@{s.address}" for s in specs)
    kinds = {s.backend for s in specs}
    kind = "simulated" if kinds == {"sim"} else "vLLM" if kinds == {"vllm"} else "mixed"
    return "\n".join(
        [
            f"Switchyard is up: {len(specs)} {kind} engine(s) [{fleet}], policy {policy}",
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


def up_agent_specs(args: argparse.Namespace, profiles: Sequence[str]) -> list[AgentSpec]:
    """The agents `switchyard up` starts (after `check_up_args`); under --plan each also gets `--combo`, and
    `--role` in a disaggregated combo."""
    specs = plan_agents(
        args.engines,
        profiles,
        args.base_agent_port,
        args.host,
        backend=args.backend,
        model=args.model,
        extra_args=(*star_agent_args(args),
                    *(("--drain-grace-s", f"{AUTOSCALE_DRAIN_S:g}") if args.autoscale else ())),
    )
    if args.plan_specs is not None:  # each engine reports its combo copy (and its role in it)
        specs = [dataclasses.replace(spec, extra_args=(*spec.extra_args, "--combo", planned.combo,
                                                       *(("--role", planned.role) if planned.role else ())))
                 for spec, planned in zip(specs, args.plan_specs, strict=True)]
    return specs


def plan_policy_params(args: argparse.Namespace) -> dict[str, Any]:
    """goodput_rr under --plan routes by the plan's goodput per combo type; other cases: no parameters."""
    if args.plan_specs is None or args.policy != "goodput_rr":
        return {}
    from gateway.policies.goodput_rr import combo_type  # noqa: PLC0415

    return {"goodput": {combo_type(e.combo): e.goodput_rps for e in args.plan_specs}}


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
    fleet = LocalFleet(specs, start_timeout_s=args.startup_timeout_s)
    judge = JudgeStub(args)
    try:
        starting = asyncio.create_task(fleet.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        starting.result()
        models = await _served_models(specs)
        await judge.start()
        cascades = cascade_configs(args, judge.url) if args.cascade_specs and judge.url else []
        config = GatewayConfig(
            host=args.host,
            port=args.port,
            policy=PolicyConfig(name=args.policy, params=plan_policy_params(args)),
            plan_file=args.plan,
            engines=tuple(s.address for s in specs),
            drain_timeout_s=args.drain_timeout_s,
            workers=args.gateway_workers,
            log_level=args.log_level,
            reschedule=RescheduleConfig(policy=args.reschedule),
            autoscale=args.autoscale_config or AutoscaleConfig(),
            cascades=tuple(cascades),
        )
        app = None
        if config.autoscale.enabled:  # this process applies the gateway's decisions to its local fleet
            actuator = LocalActuator(fleet, next_port=args.base_agent_port + len(specs), host=args.host,
                                     agent_args=star_agent_args(args), drain_s=AUTOSCALE_DRAIN_S)
            app = build_app(config, actuator=actuator)

        def announce(base_url: str) -> None:
            print(banner(base_url, specs, models, args.policy), flush=True)
            for cascade in cascades:
                stages = " -> ".join(
                    s.model if s.threshold is None else f"{s.model} (accept at {s.threshold:g})"
                    for s in cascade.stages)
                print(f"  cascade {cascade.name}: {stages}; judge {cascade.judge.url}", flush=True)

        if config.workers == 1:
            await serve(config, stop=stop, on_listening=announce, handle_signals=False, app=app)
        else:
            await supervise(config, stop=stop, on_listening=announce, handle_signals=False)
        return 0
    finally:
        await judge.stop()
        await fleet.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def up(argv: Sequence[str]) -> int:
    parser = build_up_parser()
    args = parser.parse_args(argv)
    from gateway.policies.registry import POLICY_NAMES  # noqa: PLC0415
    from switchyard.profiles import known_profiles  # noqa: PLC0415 (only `up` needs the agent package)

    check_up_args(parser, args)
    profiles = args.profile or ([DEFAULT_PROFILE] if args.backend == "sim" else [])
    if args.plan_specs is not None:
        profiles = [e.profile for e in args.plan_specs]
    unknown = [p for p in profiles if p not in known_profiles()]
    if unknown:
        parser.error(f"unknown profile {unknown[0]!r}; known: {', '.join(known_profiles())}")
    if args.policy not in POLICY_NAMES:
        parser.error(f"unknown policy {args.policy!r}; known: {', '.join(POLICY_NAMES)}")
    try:
        specs = up_agent_specs(args, profiles)
    except ValueError as e:
        parser.error(str(e))
    configure_logging(GatewayConfig(log_level=args.log_level))
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(_up(args, specs))
    except (FleetError, WorkerFailed) as e:
        print(f"switchyard up: error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"switchyard up: error: {e}", file=sys.stderr)
        return 2


def build_tiny_model_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="switchyard tiny-model",
        description="Write a tiny random-weight Llama model (config, safetensors, the repository's "
        "tokenizer) that vLLM and HF transformers load from local files.",
    )
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="model directory to write")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 4 x hidden size")
    p.add_argument("--max-position", type=int, default=2048, help="context length (max_position_embeddings)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    p.add_argument("--force", action="store_true", help="overwrite the model files in a non-empty DIR")
    return p


def tiny_model(argv: Sequence[str]) -> int:
    args = build_tiny_model_parser().parse_args(argv)
    from engine_agent.tiny_model import TinyModelError, build_tiny_model  # noqa: PLC0415 (only when asked)

    try:
        out = build_tiny_model(
            args.out,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position,
            seed=args.seed,
            force=args.force,
        )
    except (TinyModelError, OSError) as e:
        print(f"switchyard tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}; serve it with: switchyard up --backend vllm --model {shlex.quote(str(out))}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "up":
        return up(rest)
    if command == "tiny-model":
        return tiny_model(rest)
    if command == "gateway":
        return gateway_main(rest, prog="switchyard gateway")
    if command == "agent":
        from engine_agent.__main__ import main as agent_main  # noqa: PLC0415 (agent code only when asked)

        return agent_main(rest, prog="switchyard agent")
    if command == "predictor":
        from engine_agent.star.cli import main as predictor_main  # noqa: PLC0415 (numpy training code)
        from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
        from loadgen.paths import resolve_data_dir  # noqa: PLC0415

        return predictor_main(
            rest,
            prog="switchyard predictor",
            load_requests=lambda name, data_dir, n, seed: load_dataset(
                name, resolve_data_dir(data_dir), num_requests=n, seed=seed
            ),
        )
    if command == "gpus":
        from launcher.planning_cli import gpus  # noqa: PLC0415

        return gpus(rest)
    if command == "profile-combos":
        from launcher.planning_cli import profile_combos  # noqa: PLC0415

        return profile_combos(rest)
    if command == "plan":
        from launcher.planning_cli import plan  # noqa: PLC0415

        return plan(rest)
    if command == "plan-stages":
        from launcher.stages_cli import plan_stages_command  # noqa: PLC0415

        return plan_stages_command(rest)
    print(
        f"switchyard: error: unknown command {command!r} "
        "(choose from up, tiny-model, gateway, agent, predictor, gpus, plan, profile-combos, plan-stages)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())

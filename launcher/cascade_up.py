"""`switchyard up --cascade ...`: cascades served as models by the local fleet, and a judge for them.

Owns: the up command's cascade flags (`--cascade NAME=MODEL:T,...,MODEL`, repeatable; the judge:
`--judge-stub` with its faults `--judge-delay-ms|--judge-fail-rate|--judge-malformed-rate`, or `--judge-url
URL --judge-model M`; `--judge-timeout-s`, `--judge-output`, `--on-judge-failure`, `--cascade-streaming`),
their checks (one line, exit 2), the judge stub's life beside the gateway (`JudgeStub`: started on a free port
in this process, stopped with the fleet) and the gateway's `cascades` config.
Must not: judge, or decide anything of a cascade (`gateway.cascade` does).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from gateway.cascade.core import CascadeSpecError, parse_cascade
from gateway.cascade.judge_stub import serve_stub
from gateway.config import CascadeConfig


def add_cascade_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cascades (Cascadia; docs/cascadia.md)")
    g.add_argument(
        "--cascade",
        action="append",
        default=[],
        metavar="NAME=MODEL:T,...,MODEL",
        help="serve a cascade as model NAME (e.g. cascade-llama3=llama3-8b:90,llama3-70b): each stage "
        "answers, the judge scores it 0-100, below T it escalates; repeatable",
    )
    g.add_argument(
        "--judge-stub",
        action="store_true",
        help="run a judge stub beside the gateway: an OpenAI server rating answers from the MT-Bench "
        "quality profile by question and judged model (it does not read the answer)",
    )
    g.add_argument("--judge-delay-ms", type=float, default=0.0, help="judge stub: delay before every verdict")
    g.add_argument("--judge-fail-rate", type=float, default=0.0, help="judge stub: share answered with 503")
    g.add_argument(
        "--judge-malformed-rate", type=float, default=0.0, help="judge stub: share answered without a rating"
    )
    g.add_argument("--judge-url", metavar="URL", help="an OpenAI-compatible judge, e.g. http://host:8080/v1")
    g.add_argument("--judge-model", metavar="NAME", help="with --judge-url: the judge model's name")
    g.add_argument("--judge-timeout-s", type=float, default=2.0, help="a later verdict is a judge failure")
    g.add_argument(
        "--judge-output",
        choices=("rating", "explain"),
        default="rating",
        help="rating: ask for [[k]] only; explain: FastChat's template verbatim",
    )
    g.add_argument("--on-judge-failure", choices=("escalate", "accept"), default="escalate")
    g.add_argument("--cascade-streaming", choices=("final_live", "buffered"), default="final_live")


def check_cascade_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors (exit 2) for cascade flags that cannot work together; fills `args.cascade_specs`."""
    stub_faults = args.judge_delay_ms or args.judge_fail_rate or args.judge_malformed_rate
    if not args.cascade:
        if args.judge_stub or args.judge_url or stub_faults:
            parser.error("--judge-* flags are for --cascade")
        args.cascade_specs = []
        return
    if args.judge_stub == bool(args.judge_url):
        parser.error("a cascade needs one judge: --judge-stub, or --judge-url URL --judge-model NAME")
    if args.judge_url and not args.judge_model:
        parser.error("--judge-url needs --judge-model NAME")
    if stub_faults and not args.judge_stub:
        parser.error(
            "--judge-delay-ms, --judge-fail-rate and --judge-malformed-rate are the stub's (--judge-stub)"
        )
    if args.judge_delay_ms < 0 or not (
        0 <= args.judge_fail_rate <= 1 and 0 <= args.judge_malformed_rate <= 1
    ):
        parser.error("--judge-delay-ms must be >= 0 and the judge rates in [0, 1]")
    try:
        args.cascade_specs = [parse_cascade(text) for text in args.cascade]
    except CascadeSpecError as e:
        parser.error(f"--cascade: {e}")


def cascade_configs(args: argparse.Namespace, judge_url: str) -> list[CascadeConfig]:
    """The gateway's `cascades` for the parsed specs, every one judged at `judge_url`."""
    judge: dict[str, Any] = {
        "kind": "openai",
        "url": judge_url,
        "timeout_s": args.judge_timeout_s,
        "output": args.judge_output,
        "model": args.judge_model or "switchyard-judge-stub",
    }
    return [
        CascadeConfig.model_validate(
            {
                "name": spec.name,
                "judge": judge,
                "on_judge_failure": args.on_judge_failure,
                "streaming": args.cascade_streaming,
                "stages": [{"model": s.model, "threshold": s.threshold} for s in spec.stages],
            }
        )
        for spec in args.cascade_specs
    ]


class JudgeStub:
    """The judge stub (`gateway.cascade.judge_stub.serve_stub`) as a task of this process, on a free port of
    `host` (or none, when not asked for)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.url: str | None = args.judge_url

    async def start(self) -> None:
        args = self._args
        if not args.judge_stub:
            return
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(serve_stub(
            args.host, 0, delay_ms=args.judge_delay_ms, fail_rate=args.judge_fail_rate,
            malformed_rate=args.judge_malformed_rate, stop=self._stop, on_listening=listening.set_result,
            handle_signals=False), name="judge-stub")
        done, _ = await asyncio.wait({listening, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if listening not in done:  # it failed before listening: raise its error
            self._task.result()
        self.url = f"{listening.result()}/v1"

    async def stop(self) -> None:
        if self._task is not None:
            self._stop.set()
            await self._task
            self._task = None

"""`switchyard up --cascade`: the flag rules (one line, exit 2) and the gateway config they become."""

from __future__ import annotations

import pytest

from launcher.cascade_up import cascade_configs
from launcher.cli import build_up_parser, check_up_args


def parsed(*argv: str):  # type: ignore[no-untyped-def]
    parser = build_up_parser()
    args = parser.parse_args(list(argv))
    check_up_args(parser, args)
    return args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cascade", "c=a:90,b"], "needs one judge"),
        (["--cascade", "c=a:90,b", "--judge-stub", "--judge-url", "http://j:1/v1"], "needs one judge"),
        (["--cascade", "c=a:90,b", "--judge-url", "http://j:1/v1"], "--judge-model"),
        (
            [
                "--cascade",
                "c=a:90,b",
                "--judge-url",
                "http://j:1/v1",
                "--judge-model",
                "m",
                "--judge-fail-rate",
                "0.5",
            ],
            "the stub's",
        ),
        (["--cascade", "c=a:90,b", "--judge-stub", "--judge-fail-rate", "2"], "in \\[0, 1\\]"),
        (["--cascade", "c=a,b", "--judge-stub"], "needs a threshold"),
        (["--judge-stub"], "are for --cascade"),
    ],
)
def test_bad_cascade_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parsed(*argv)
    assert exit_.value.code == 2
    assert message.replace("\\", "") in capsys.readouterr().err.replace("\\", "")


def test_cascades_become_gateway_config() -> None:
    args = parsed(
        "--cascade",
        "cascade-llama3=llama3-8b:90,llama3-70b",
        "--judge-stub",
        "--judge-timeout-s",
        "1.5",
        "--cascade-streaming",
        "buffered",
    )
    (config,) = cascade_configs(args, "http://127.0.0.1:9/v1")
    assert config.name == "cascade-llama3" and config.streaming == "buffered"
    assert [(s.model, s.threshold) for s in config.stages] == [("llama3-8b", 90.0), ("llama3-70b", None)]
    assert (config.judge.kind, config.judge.url, config.judge.timeout_s) == (
        "openai",
        "http://127.0.0.1:9/v1",
        1.5,
    )

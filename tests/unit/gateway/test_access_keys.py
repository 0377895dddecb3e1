"""The API key file and constant-time authentication (gateway.access.keys)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.__main__ import build_argparser, cli_overrides
from gateway.access.keys import ApiKey, KeyTable, load_key_table
from gateway.config import ConfigError, build_config
from launcher.cli import main as launcher_main

ALICE = "sk-alice-0123456789"
BOB = "sk-bob-0123456789"
CAROL = "sk-carol-0123456789"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def table(*entries: dict[str, Any]) -> KeyTable:
    return KeyTable.parse({"keys": list(entries)})


def test_entries_become_keys_with_their_limits() -> None:
    t = table(
        {
            "name": "alice",
            "key": ALICE,
            "models": ["m1", "m2"],
            "requests_per_s": 2.5,
            "tokens_per_min": 600,
            "max_concurrent_streams": 3,
            "priority": 1,
        },
        {"name": "ops", "key_sha256": sha(BOB), "admin": True},
    )
    alice, ops = list(t)
    assert (alice.name, alice.models, alice.requests_per_s, alice.tokens_per_min) == (
        "alice",
        frozenset({"m1", "m2"}),
        2.5,
        600,
    )
    assert (alice.max_concurrent_streams, alice.priority, alice.admin) == (3, 1, False)
    # Absent limits are unlimited, absent models are all models.
    assert (ops.models, ops.requests_per_s, ops.tokens_per_min, ops.max_concurrent_streams) == (
        None,
        None,
        None,
        None,
    )
    assert ops.admin and ops.allows("anything") and alice.allows("m1") and not alice.allows("m3")


@pytest.mark.parametrize(
    ("presented", "expected"),
    [
        (ALICE, "alice"),
        (BOB, "bob"),  # stored as a digest only
        (CAROL, "carol"),  # the last entry: every entry is compared, none skipped
        (ALICE + " ", None),
        (ALICE[:-1], None),
        ("", None),
        (sha(ALICE), None),  # the digest is not the key
        ("sk-ålice-0123456789", None),
    ],
)
def test_authenticate_returns_the_matching_key(presented: str, expected: str | None) -> None:
    t = table(
        {"name": "alice", "key": ALICE},
        {"name": "bob", "key_sha256": sha(BOB)},
        {"name": "carol", "key": CAROL},
    )
    found = t.authenticate(presented)
    assert (found.name if found else None) == expected


def test_authenticate_compares_every_entry_by_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time in which entry matches: one compare_digest per entry, on digests, wherever the match."""
    import gateway.access.keys as keys_module

    t = table({"name": "a", "key": ALICE}, {"name": "b", "key": BOB}, {"name": "c", "key": CAROL})
    calls: list[tuple[bytes, bytes]] = []
    real = keys_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting)
    for presented in (ALICE, CAROL, "nobody-at-all"):
        calls.clear()
        t.authenticate(presented)
        assert len(calls) == 3
        assert all(len(a) == len(b) == 32 for a, b in calls)
        assert {b for _, b in calls} == {hashlib.sha256(presented.encode()).digest()}


def test_a_key_never_shows_in_repr() -> None:
    t = table({"name": "alice", "key": ALICE})
    (alice,) = list(t)
    assert ALICE not in repr(alice) and sha(ALICE) not in repr(alice)
    assert "digest" not in repr(alice)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "list at least one key"),
        ([{"name": "a", "key": ALICE}, {"name": "a", "key": BOB}], "keys.1 ('a'): same name as keys.0 ('a')"),
        (
            [{"name": "a", "key": ALICE}, {"name": "b", "key": ALICE}],
            "keys.1 ('b'): same key as keys.0 ('a')",
        ),
        # The same key once raw, once as its digest, is still the same key.
        ([{"name": "a", "key": ALICE}, {"name": "b", "key_sha256": sha(ALICE)}], "same key as keys.0"),
        ([{"name": "a"}], "keys.0 ('a'): give exactly one of `key` or `key_sha256`"),
        ([{"name": "a", "key": ALICE, "key_sha256": sha(ALICE)}], "exactly one of"),
        ([{"name": "a", "key": "short"}], "keys.0 ('a'): key: at least 8 characters"),
        ([{"name": "a", "key_sha256": sha(ALICE).upper()}], "keys.0.key_sha256 ('a')"),
        ([{"name": "a", "key": ALICE, "models": []}], "list at least one model"),
        ([{"name": "a", "key": ALICE, "requests_per_s": 0}], "keys.0.requests_per_s ('a'): Input should be"),
        ([{"name": "a", "key": ALICE, "tokens_per_min": -5}], "keys.0.tokens_per_min"),
        ([{"name": "a", "key": ALICE, "max_concurrent_streams": 0}], "keys.0.max_concurrent_streams"),
        ([{"name": "a", "key": ALICE, "rate": 1}], "keys.0.rate ('a'): Extra inputs are not permitted"),
        ([{"name": "has space", "key": ALICE}], "keys.0.name"),
        ([{"name": "unauthenticated", "key": ALICE}], "reserved"),
    ],
)
def test_bad_files_are_rejected_naming_the_entry(entries: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        table(*entries)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "entry",
    [
        {"name": "a", "key": "sk-too"},  # too short
        {"name": "a", "key": "sk-secret-value", "bogus": "sk-secret-value"},
        {"name": "a", "key": "sk-secret-value", "key_sha256": "sk-secret-value"},
        {"name": "a", "key": "sk-secret-value", "models": "sk-secret-value"},
        {"name": "a", "key": ["sk-secret-value"]},
    ],
)
def test_errors_never_quote_a_key(entry: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as exc:
        table(entry, {"name": "b", "key": "sk-other-secret"})
    text = str(exc.value)
    assert text.startswith("key file: keys.0")
    assert "sk-too" not in text and "sk-other-secret" not in text and "sk-secret-value" not in text


def test_load_yaml_and_json_files(tmp_path: Path) -> None:
    yaml_file = tmp_path / "keys.yaml"
    yaml_file.write_text(
        "keys:\n"
        f"  - name: alice\n    key: {ALICE}\n    models: [m]\n    tokens_per_min: 1000\n"
        f"  - name: bob\n    key_sha256: {sha(BOB)}\n    models: '*'\n"
    )
    json_file = tmp_path / "keys.json"
    json_file.write_text(json.dumps({"keys": [{"name": "alice", "key": ALICE, "models": ["m"]}]}))
    from_yaml, from_json = load_key_table(yaml_file), load_key_table(json_file)
    assert from_yaml.authenticate(ALICE) == ApiKey("alice", frozenset({"m"}), tokens_per_min=1000)
    assert from_yaml.authenticate(BOB) == ApiKey("bob", None)
    assert from_json.authenticate(ALICE) == ApiKey("alice", frozenset({"m"}))
    assert from_json.authenticate(BOB) is None


def test_unreadable_or_unparsable_files_name_the_file_but_not_its_text(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_key_table(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text(f'keys:\n  - name: a\n    key: "{ALICE}\n  bad: [\n')
    with pytest.raises(ConfigError) as exc:
        load_key_table(broken)
    assert f"API key file {broken}: cannot parse it (line" in str(exc.value)
    assert ALICE not in str(exc.value)
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('{"keys": [{"name": "a", "key": "' + ALICE + '"')
    with pytest.raises(ConfigError) as exc:
        load_key_table(broken_json)
    assert "cannot parse it (line 1" in str(exc.value) and ALICE not in str(exc.value)
    listing = tmp_path / "list.json"
    listing.write_text("[]")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_key_table(listing)


def test_the_flag_the_environment_and_the_config_file_name_the_key_file(tmp_path: Path) -> None:
    args = build_argparser().parse_args(["--api-keys", "keys.yaml"])
    assert build_config(environ={}, cli=cli_overrides(args)).api_keys_file == "keys.yaml"
    env = {"SWITCHYARD_GATEWAY_API_KEYS_FILE": "from-env.json"}
    assert build_config(environ=env).api_keys_file == "from-env.json"
    config_file = tmp_path / "gateway.json"
    config_file.write_text(json.dumps({"api_keys_file": "from-file.yaml"}))
    assert build_config(file_path=config_file, environ={}).api_keys_file == "from-file.yaml"
    assert build_config(environ={}).api_keys_file is None  # the open gateway


def test_a_bad_key_file_stops_switchyard_gateway_before_it_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"keys": [{"name": "alice", "key": ALICE, "models": []}]}))
    assert launcher_main(["gateway", "--engine", "127.0.0.1:1", "--api-keys", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"switchyard gateway: error: API key file {bad}: keys.0 ('alice'): models:" in err
    assert ALICE not in err

"""The committed stubs must equal what `make proto` generates from proto/engine_agent.proto."""

from pathlib import Path

from switchyard.proto_gen import regen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generated = regen.generate(tmp_path)
    for fresh in generated:
        committed = regen.REPO / regen.PACKAGE_DIR / fresh.name
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed.name} is stale: run `make proto`"


def test_stubs_import_and_describe_the_service() -> None:
    from switchyard.proto_gen import engine_agent_pb2, engine_agent_pb2_grpc

    service = engine_agent_pb2.DESCRIPTOR.services_by_name["EngineAgent"]
    assert {m.name for m in service.methods} >= {"Generate", "Abort", "WatchState", "GetInfo"}
    assert hasattr(engine_agent_pb2_grpc, "EngineAgentStub")

"""Generated protobuf/gRPC stubs for `proto/engine_agent.proto`. Never edit by hand: run `make proto`."""

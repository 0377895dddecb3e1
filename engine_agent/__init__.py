"""engine_agent package."""

"""switchyard package."""

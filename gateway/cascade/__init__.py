"""Cascade serving (Cascadia): quality profiles, the judge, the cascade's decisions and its planner."""

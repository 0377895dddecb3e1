"""The roof: the `switchyard` command (`launcher.cli`) and the local fleet it starts (`launcher.local_fleet`).

Nothing in gateway/, engine_agent/, loadgen/ or switchyard/ imports this package.
"""

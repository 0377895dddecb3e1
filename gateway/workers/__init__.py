"""The gateway past one core: a supervisor (`supervisor.py`) and N worker processes (`worker.py`) serving one
port, with what they hand each other (`spec.py`). `--workers 1` (the default) uses none of it."""

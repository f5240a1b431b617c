"""The `hybridrt` command line. `commands.py` holds the typer app, `main` (bad input -> one `error:` line,
exit 2) and the small commands (info, pull, warmup); each larger command has its own module (run, plan,
bench, serve, train_mtp); `options.py` declares every flag that several commands share, once."""
from .commands import app, main

__all__ = ["app", "main"]

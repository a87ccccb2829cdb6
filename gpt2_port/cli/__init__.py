"""The `gpt2-port` command: the entry point (main.py) and one module per subcommand (argparse -> library call ->
printing and exit codes). The only place that prints."""

from .main import main, run

__all__ = ["main", "run"]

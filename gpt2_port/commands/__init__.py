"""Subcommands of `gpt2-port`, one module each (see cli.COMMAND_MODULES)."""

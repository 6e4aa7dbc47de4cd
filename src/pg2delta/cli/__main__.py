"""``python -m pg2delta.cli``: the command line, as the ``pg2delta`` script runs it."""

from pg2delta.cli import entry

entry()

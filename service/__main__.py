"""`python -m service [flags]` is `prefixserve serve [flags]`; `python -m service generate ...` also works.

An entry script, not part of the service library: it hands over to the CLI (cli.py), which sits above
the service."""
import sys

from cli import main

args = sys.argv[1:]
main(args if args[:1] in (["serve"], ["generate"], ["-h"], ["--help"]) else ["serve", *args], reexec=True)

"""`python -m service [flags]` is `prefixserve serve [flags]`; `python -m service generate ...` also works."""
import sys

from cli import main

args = sys.argv[1:]
main(args if args[:1] in (["serve"], ["generate"], ["-h"], ["--help"]) else ["serve", *args])

"""`python -m flashnext.bench decode …`: the same as `flashnext bench decode …`, without the main CLI."""
import sys

from flashnext.bench.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))

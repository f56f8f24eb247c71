"""`python -m flashnext.bench bench …`: the bench CLI on its own (the same as `flashnext bench …`)."""
import sys

from flashnext.bench.cli import main

sys.exit(main())

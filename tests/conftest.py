import os
import sys

# The oracle helpers import as plain modules from the tests folder.
sys.path.insert(0, os.path.dirname(__file__))

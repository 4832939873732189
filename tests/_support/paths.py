"""Folders the tests read: the repository, the tests, their support files,
the examples and benchmarks."""
import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
ROOT = os.path.dirname(TESTS)
FILES = os.path.join(SUPPORT, "files")        # checkpoints written by older versions
EXAMPLES = os.path.join(ROOT, "examples")
BENCHMARKS = os.path.join(ROOT, "benchmarks")

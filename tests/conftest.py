import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# the development scripts (tools/dev/, not installed) that tests import by name
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "dev"))


def pytest_addoption(parser):
    parser.addoption("--grid-sample", type=int, default=0,
                     help="run only a seeded sample of N FLASH_ATTN_EXT conformance cases (default: all)")

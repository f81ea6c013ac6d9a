"""The DFlash unit tests' shared model: a frozen 5-layer target and a 2-layer draft (tests/stagekit.py)."""

import pytest
from stagekit import dflash_pair


@pytest.fixture(scope="module")
def pair():
    return dflash_pair()

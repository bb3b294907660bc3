import os

import pytest
import torch

# Tests share two cores with nothing else; two threads keep runs reproducible and quick.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

"""The GPU suite (`make test-gpu`): the tiny-family identities, rebuilt patterns, capture, generation and edits on an
accelerator, in each dtype. Everything skips where the device is missing; `--device cpu` runs it here to try it.

    python -m pytest tests_gpu [--device cuda] [--dtypes float32,bfloat16]
"""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default="cuda", help="the device to run on (default cuda)")
    parser.addoption("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to run in")


def pytest_generate_tests(metafunc):
    if "dtype" in metafunc.fixturenames:
        names = metafunc.config.getoption("--dtypes").split(",")
        metafunc.parametrize("dtype", [getattr(torch, name) for name in names], ids=names)


@pytest.fixture(scope="session")
def device(request):
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU suite runs where one is (make test-gpu)")
    return torch.device(name)

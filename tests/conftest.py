import os
import time
import zlib

# Triton kernels run under the interpreter on machines without a GPU. The variable is read when a
# kernel module is imported, so it is set before anything imports the ops.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_dsv4_hw.ops.registry import REGISTRY  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test starts with no cached backend choice and no VLLM_DSV4_HW_* overrides."""
    for name in list(os.environ):
        if name.startswith("VLLM_DSV4_HW_"):
            monkeypatch.delenv(name)
    REGISTRY.clear_cache()
    yield
    REGISTRY.clear_cache()


# Fresh random inputs on every run; DSV4_TEST_SEED=<n> replays a run (the header prints it).
SESSION_SEED = int(os.environ.get("DSV4_TEST_SEED", int(time.time()) % 1_000_000))


def pytest_report_header(config):
    return f"dsv4 test seed: DSV4_TEST_SEED={SESSION_SEED}"


@pytest.fixture
def gen(request):
    """A generator per test: fresh each run, reproducible with DSV4_TEST_SEED."""
    return torch.Generator().manual_seed(SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode()))

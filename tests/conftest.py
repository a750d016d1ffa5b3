# SPDX-License-Identifier: Apache-2.0
import os
import sys
import time
import zlib

# A stub torch_npu (tests/stubs/torch_npu: documented operator semantics in PyTorch, on CPU) for the
# whole session, so the npu backend runs through the conformance tests on CPU tensors. It is only
# importable while the tests run; it reports no NPU unless a test asks (tests/npu/conftest.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))

# Triton kernels run under the interpreter on machines without a GPU. The variable is read when a
# kernel module is imported, so it is set before anything imports the ops.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import strict_interpreter  # noqa: E402
from vllm_dsv4_hw.ops.registry import REGISTRY  # noqa: E402

# The interpreter rejects launch keywords a GPU launch rejects (it would drop them silently).
strict_interpreter.install()


@pytest.fixture(autouse=True, scope="session")
def _npu_stub_on_cpu_tensors():
    """With the stub, the npu backend's ops run on CPU tensors, so an explicit request for it
    (VLLM_DSV4_HW_BACKEND / _OP_BACKENDS) resolves on 'cpu', as triton does under the interpreter.
    Automatic selection on 'cpu' is unchanged (its order holds only the reference)."""
    from vllm_dsv4_hw.ops import backends

    real = backends._probe

    def probe(backend, device_type):
        if backend == "npu" and device_type == "cpu":
            return True, "torch_npu stub on CPU tensors (tests only)"
        return real(backend, device_type)

    backends._probe = probe
    backends.clear_cache()
    yield
    backends._probe = real
    backends.clear_cache()


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    # the ahead-of-time matrix's tests last: their compiles run meanwhile (tests/aot/background.py)
    from tests.aot.background import uses_matrix

    items[:] = [i for i in items if not uses_matrix(i)] + [i for i in items if uses_matrix(i)]


def pytest_collection_finish(session):
    """Note whether a selected test needs the matrix's compiles (started by the first test that
    does not time a process from its start: ``serve_first``)."""
    from tests.aot import background

    session.config._dsv4_aot_wanted = not session.config.option.collectonly and any(
        background.uses_matrix(i) for i in session.items
    )


def pytest_runtest_setup(item):
    config = item.config
    if getattr(config, "_dsv4_aot_wanted", False) and not item.get_closest_marker("serve_first"):
        config._dsv4_aot_wanted = False
        from tests.aot import background
        from tests.subprocess_scripts import HAS_PTXAS

        if HAS_PTXAS:
            background.start(config)


def pytest_sessionfinish(session, exitstatus):
    jobs = getattr(session.config, "_dsv4_aot", None)
    if jobs is not None:
        jobs.stop()


def pytest_report_header(config):
    return f"dsv4 test seed: DSV4_TEST_SEED={SESSION_SEED}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # again at the end: CI logs are often cut to their tail, and a failure needs the seed to replay
    if exitstatus != 0:
        terminalreporter.write_line(
            f"dsv4 test seed: DSV4_TEST_SEED={SESSION_SEED} replays this run"
        )


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small-tensor tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): more threads only add spin-wait overhead, and two
    OpenMP threads on a 2-core machine stall whenever another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def vllm_single_rank():
    """vLLM's parallel state for this process (world size 1), as a worker sets it up: the model's
    linears are vLLM layers, which read their tensor-parallel rank from it. Modules that build
    layers use it with ``pytestmark = pytest.mark.usefixtures("vllm_single_rank")``."""
    from benchmarks.vllm_state import single_rank

    single_rank()


@pytest.fixture
def gen(request):
    """A generator per test: fresh each run, reproducible with DSV4_TEST_SEED."""
    return torch.Generator().manual_seed(SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode()))

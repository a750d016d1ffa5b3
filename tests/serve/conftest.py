# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the serve suite: tiny checkpoints made once per session, and ``vllm serve`` processes.

A server costs about 35-50 s to become healthy on 2 cores, so the suite starts few and overlaps
their startups with tests:

* A test module declares its servers in a module-level ``SERVERS`` dict, keyed by the fixture that
  returns the server: ``{"ref_server": ServerSpec("ref", checkpoint="bf16", args=[...])}``; its
  fixture calls ``vllm_servers.get(SERVERS["ref_server"])`` and ``vllm_servers.stop(...)`` at the
  end of the module.
* After collection, the pool knows in which order the selected tests first use each server. When
  one becomes healthy, the pool launches the next one in that order in the background, so that its
  startup runs while the tests of the current one do.

Servers not declared that way work too: ``vllm_servers.get(ServerSpec(...))`` starts one on first
use (no overlap). Whatever still runs is stopped at the end of the session. A failing test that used
a server gets the tail of that server's log in its report; the terminal summary lists the startups.
"""

from __future__ import annotations

import pytest

from tests.serve.server import ServerPool, ServerSpec


def pytest_collection_modifyitems(session, config, items):
    # Tests that time a vllm serve process from its start run first, before any pooled server
    # starts in the background and competes for the two cores.
    first = [i for i in items if i.get_closest_marker("serve_first")]
    if first:
        rest = [i for i in items if not i.get_closest_marker("serve_first")]
        items[:] = first + rest
    plan: list[ServerSpec] = []
    for item in items:
        servers = getattr(item.module, "SERVERS", None) or {}
        for fixture in item.fixturenames:
            spec = servers.get(fixture)
            if spec is not None and spec not in plan:
                plan.append(spec)
    config._dsv4_server_plan = plan


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory, request):
    pool = ServerPool(tmp_path_factory)
    pool.plan = list(getattr(request.config, "_dsv4_server_plan", []))
    request.config._dsv4_server_pool = pool
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def ckpt_fp8(vllm_servers):
    """tiny-flash, FP8 linears + FP4 experts (the official format; what ``make serve`` serves)."""
    return vllm_servers.checkpoint("fp8")


@pytest.fixture(scope="session")
def ckpt_bf16(vllm_servers):
    """tiny-flash with the same weights as ``ckpt_fp8`` (seed 0) stored as bf16."""
    return vllm_servers.checkpoint("bf16")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    pool = getattr(item.config, "_dsv4_server_pool", None)
    if not (rep.failed and call.when in ("setup", "call") and pool):
        return
    used = {id(v) for v in getattr(item, "funcargs", {}).values()}
    mine = [(n, s) for n, s in pool.servers.items() if id(s) in used]
    for name, server in mine or list(pool.servers.items()):
        rep.sections.append((f"vllm serve {name!r} log tail", server.log_tail(60)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    pool = getattr(config, "_dsv4_server_pool", None)
    if pool and pool.startups:
        times = ", ".join(
            f"{n} {s:.0f} s{' (in background)' if bg else ''}" for n, s, bg in pool.startups
        )
        terminalreporter.write_line(f"vllm serve startups: {times}")

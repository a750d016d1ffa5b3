# SPDX-License-Identifier: Apache-2.0
"""The stream layer: inline on CPU, event-ordered branches on devices with streams.

The ordering on a device is checked with a recording fake of the device module (the same API
surface torch.cuda and torch.npu expose); real overlap is checked on a GPU by the GPU tier
(tests/gpu/test_kernels.py::test_aux_streams_overlap, ``make test-gpu``).
"""

import contextlib

import pytest
import torch

from vllm_dsv4_hw.platform.streams import AuxStreams


class _Recorder:
    def __init__(self):
        self.log = []
        self.created = 0
        self.main = _Stream(self, "main")
        self.current = self.main

    # the torch.cuda-like surface
    def Stream(self):
        self.created += 1
        return _Stream(self, f"aux{self.created - 1}")

    def Event(self):
        return _Event(self)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    @contextlib.contextmanager
    def device(self, d):
        yield


class _Stream:
    def __init__(self, rec, name):
        self.rec, self.name = rec, name
        rec.log.append(("new_stream", name))

    def wait_stream(self, other):
        self.rec.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev):
        self.rec.log.append(("wait_event", self.name, ev.recorded_on))


class _Event:
    def __init__(self, rec):
        self.rec, self.recorded_on = rec, None

    def record(self, stream):
        self.recorded_on = stream.name
        self.rec.log.append(("record", stream.name))


def test_cpu_runs_branches_inline_in_order():
    aux = AuxStreams("cpu", 2)
    assert not aux.parallel
    out = []
    with aux.branch(0):
        out.append(torch.ones(2) * 1)
    with aux.branch(1):
        out.append(torch.ones(2) * 2)
    aux.join()
    assert [float(t[0]) for t in out] == [1.0, 2.0]


def test_device_branches_wait_for_main_then_main_waits_for_branches():
    rec = _Recorder()
    aux = AuxStreams("cpu", 2, enabled=True, module=rec)
    assert aux.parallel
    seen = []
    with aux.branch(0):
        seen.append(rec.current.name)
    with aux.branch(1):
        seen.append(rec.current.name)
    seen.append(rec.current.name)
    aux.join()
    assert seen == ["aux0", "aux1", "main"]
    ops = [e for e in rec.log if e[0] != "new_stream"]
    assert ops == [
        ("wait_stream", "aux0", "main"),
        ("record", "aux0"),
        ("wait_stream", "aux1", "main"),
        ("record", "aux1"),
        ("wait_event", "main", "aux0"),
        ("wait_event", "main", "aux1"),
    ]
    # a second join has nothing pending
    aux.join()
    assert [e for e in rec.log if e[0] != "new_stream"] == ops


def test_disabled_by_setting_runs_inline(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_MULTI_STREAM", "0")
    rec = _Recorder()
    aux = AuxStreams("cpu", 2, module=rec)
    assert not aux.parallel
    with aux.branch(0):
        assert rec.current.name == "main"
    aux.join()
    assert [e for e in rec.log if e[0] != "new_stream"] == []


def test_branch_index_out_of_range_is_clear():
    aux = AuxStreams("cpu", 1)
    with pytest.raises(IndexError, match="branch 3 out of range"):
        with aux.branch(3):
            pass


def test_context_manager_joins():
    rec = _Recorder()
    with AuxStreams("cpu", 1, enabled=True, module=rec) as aux:
        with aux.branch(0):
            pass
    assert ("wait_event", "main", "aux0") in rec.log


def test_after_waits_for_branches_started_since_the_last_join_only():
    """``after=(j,)``: the branch's stream waits for branch j's work of this step (its event
    recorded since the last join), not for an event of an earlier step (which, under CUDA-graph
    capture, may predate the capture). Out-of-range indices in ``after`` are refused."""
    rec = _Recorder()
    aux = AuxStreams("cpu", 3, enabled=True, module=rec)
    with aux.branch(2):
        pass
    aux.join()
    start = len(rec.log)
    with aux.branch(0, after=(2,)):  # branch 2 not started since the join: no wait
        pass
    with aux.branch(2):
        pass
    with aux.branch(0, after=(2,)):
        pass
    aux.join()
    assert rec.log[start:] == [
        ("wait_stream", "aux0", "main"),
        ("record", "aux0"),
        ("wait_stream", "aux2", "main"),
        ("record", "aux2"),
        ("wait_stream", "aux0", "main"),
        ("wait_event", "aux0", "aux2"),
        ("record", "aux0"),
        ("wait_event", "main", "aux0"),
        ("wait_event", "main", "aux2"),
        ("wait_event", "main", "aux0"),
    ]
    with pytest.raises(IndexError, match="branch 3 out of range"):
        with aux.branch(0, after=(3,)):
            pass


def test_after_is_inline_order_on_cpu():
    aux = AuxStreams("cpu", 3)
    out = []
    with aux.branch(2):
        out.append(2)
    with aux.branch(0, after=(2,)):
        out.append(0)
    aux.join()
    assert out == [2, 0]

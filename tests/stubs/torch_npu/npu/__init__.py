# SPDX-License-Identifier: Apache-2.0
"""``torch.npu`` of the stub: device queries and a recording model of streams and events.

The real module (torch_npu.npu) mirrors torch.cuda: ``Stream``, ``Event``, ``current_stream``,
``stream`` (context), ``device`` (context), ``synchronize``, ``is_available``, ``device_count``,
``set_device``, ``current_device``, ``get_device_name``. Here nothing runs asynchronously: work is
executed inline by PyTorch on CPU, and stream/event calls are appended to :data:`log` so tests can
check the ordering the stream layer asks for.
"""

from __future__ import annotations

import contextlib

from torch_npu import _control

log: list[tuple] = []
_current_device = 0
_created = 0


def is_available() -> bool:
    return bool(_control.available)


def device_count() -> int:
    return _control.device_count if _control.available else 0


def _check_available():
    if not _control.available:
        raise RuntimeError("torch_npu stub: no NPU is visible (set _control.available = True)")


def set_device(device) -> None:
    global _current_device
    _check_available()
    _current_device = _index(device)


def current_device() -> int:
    return _current_device


def get_device_name(device=None) -> str:
    return _control.soc_name


def synchronize(device=None) -> None:
    log.append(("synchronize",))


def _index(device) -> int:
    if device is None:
        return _current_device
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None and isinstance(device, str) and ":" in device:
        index = int(device.split(":", 1)[1])
    return _current_device if index is None else index


class Stream:
    def __init__(self, device=None, priority: int = 0, name: str | None = None):
        global _created
        self.device_index = _index(device)
        if name is None:
            name = f"aux{_created}"
            _created += 1
        self.name = name
        log.append(("new_stream", self.name))

    def wait_stream(self, other: "Stream") -> None:
        log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "Event") -> None:
        log.append(("wait_event", self.name, event.recorded_on))

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        log.append(("stream_synchronize", self.name))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<torch_npu stub Stream {self.name}>"


_default = {}
_current: dict[int, Stream] = {}


def default_stream(device=None) -> Stream:
    i = _index(device)
    if i not in _default:
        _default[i] = Stream(i, name=f"default{i}")
    return _default[i]


def current_stream(device=None) -> Stream:
    i = _index(device)
    return _current.get(i) or default_stream(i)


@contextlib.contextmanager
def stream(s: Stream | None):
    if s is None:
        yield
        return
    i = s.device_index
    prev = _current.get(i)
    _current[i] = s
    try:
        yield
    finally:
        if prev is None:
            _current.pop(i, None)
        else:
            _current[i] = prev


@contextlib.contextmanager
def device(d):
    global _current_device
    prev = _current_device
    _current_device = _index(d)
    try:
        yield
    finally:
        _current_device = prev


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.recorded_on = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self.recorded_on = stream.name
        log.append(("record", stream.name))

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def synchronize(self) -> None:
        log.append(("event_synchronize", self.recorded_on))

    def query(self) -> bool:
        return True


def reset_log() -> None:
    global _created
    log.clear()
    _default.clear()
    _current.clear()
    _created = 0

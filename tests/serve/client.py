# SPDX-License-Identifier: Apache-2.0
"""The HTTP side of a ``vllm serve`` process for tests (standard library only): the errors, the
requests a test sends (:class:`ServerClient`, the base of ``server.VllmServer``) and
:func:`map_concurrently` for requests in flight together.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

REQUEST_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error status."""


class HTTPStatusError(ServerError):
    def __init__(self, status: int, body: str, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:2000]}")
        self.status = status
        self.body = body


class ServerClient:
    """Requests to the server at ``self.url``; completions and chats name ``self.served_model_name``
    (both set by the subclass)."""

    url: str
    served_model_name: str

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> tuple[int, bytes]:
        """(status, raw body); never raises for an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        """JSON response of a 200 answer; :class:`HTTPStatusError` for any other status."""
        status, raw = self.request("POST", path, body, timeout)
        if status != 200:
            raise HTTPStatusError(status, raw.decode(errors="replace"), self.url + path)
        return json.loads(raw)

    def get(self, path: str, timeout: float = 30) -> str:
        status, raw = self.request("GET", path, None, timeout)
        if status != 200:
            raise HTTPStatusError(status, raw.decode(errors="replace"), self.url + path)
        return raw.decode()

    def completion_body(self, prompt: str | list[int], **params) -> dict:
        """Defaults: greedy, 32 new tokens, token ids returned; ``params`` override them."""
        body = {
            "model": self.served_model_name,
            "prompt": prompt,
            "max_tokens": 32,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        body.update(params)
        return body

    def complete(self, prompt: str | list[int], **params) -> dict:
        """The first choice of ``/v1/completions`` (``token_ids``, ``text``, ``logprobs``,
        ``prompt_logprobs`` ...) with the response's ``usage`` added under ``"usage"``."""
        out = self.post("/v1/completions", self.completion_body(prompt, **params))
        choice = dict(out["choices"][0])
        choice["usage"] = out.get("usage")
        return choice

    def chat(self, messages: list[dict], **params) -> dict:
        """The whole ``/v1/chat/completions`` response (greedy, 32 tokens unless overridden)."""
        body = {
            "model": self.served_model_name,
            "messages": messages,
            "max_tokens": 32,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        body.update(params)
        return self.post("/v1/chat/completions", body)

    def stream(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> Iterator[dict]:
        """Server-sent events of a streamed request, parsed; stops at ``data: [DONE]``."""
        body = dict(body, stream=True)
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            resp = urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise HTTPStatusError(e.code, e.read().decode(errors="replace"), self.url + path)
        with resp:
            done = False
            for raw in resp:
                line = raw.decode().strip()
                if not line or not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                yield json.loads(data)
            if not done:
                raise ServerError(f"stream from {self.url + path} ended without [DONE]")

    def stream_completion(self, prompt: str | list[int], **params) -> list[dict]:
        return list(self.stream("/v1/completions", self.completion_body(prompt, **params)))

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of ``/metrics`` by name, summed over label sets."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
        return out

    def metric(self, name: str) -> float:
        m = self.metrics()
        if name not in m:
            raise KeyError(
                f"{name} not in /metrics of {self.url}; has e.g. "
                f"{sorted(k for k in m if k.startswith('vllm:'))[:40]}"
            )
        return m[name]


def map_concurrently(fn, items: Iterable, workers: int | None = None) -> list:
    """``[fn(x) for x in items]`` with one thread per item (all requests in flight together)."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    with ThreadPoolExecutor(max_workers=workers or max(1, len(items))) as pool:
        return list(pool.map(fn, items))

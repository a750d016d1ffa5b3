# SPDX-License-Identifier: Apache-2.0
"""Record every Triton kernel specialization a GPU run compiles (the launches the product really
makes: signature, constexprs, divisibility attributes, num_warps / num_stages), for the ahead-of-time
target matrix (``tests/aot``). Installed by ``tests/gpu/conftest.py`` when
``DSV4_RECORD_LAUNCHES=<file.json>``; the file is written at exit.

Only the package's own kernels (``vllm_dsv4_hw.*``) are kept; the records hold names, not objects,
so the matrix can rebuild each ``ASTSource`` from the module and the kernel's name.
"""

from __future__ import annotations

import atexit
import json
import threading

_RECORDS: dict[str, dict] = {}
_ERRORS: list[str] = []
_LOCK = threading.Lock()


def _value(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)  # a dtype or another constexpr object: kept as text (never one of ours today)


def _hook(**kw):
    try:
        _record(kw["fn"], kw["compile"])
    except Exception as exc:  # a recorder must never break the run it watches
        with _LOCK:
            _ERRORS.append(f"{type(exc).__name__}: {exc}")
    return False


def _record(fn, compile) -> None:  # noqa: A002
    module, name = fn.module, fn.name
    if not module.startswith("vllm_dsv4_hw."):
        return
    jit = fn.jit_function
    names = jit.arg_names
    sig = {k: str(v) for k, v in compile["signature"].items()}
    consts = {}
    for k, v in compile["constants"].items():
        arg = names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k)
        consts[arg] = _value(v)
    attrs = {}
    for k, v in (compile["configs"][0] or {}).items():
        arg = names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k)
        attrs[arg] = [list(a) for a in v]
    rec = {
        "family": module.split("vllm_dsv4_hw.ops.triton.", 1)[-1].split(".")[0],
        "kernel": name,
        "signature": sig,
        "constexprs": consts,
        "attrs": attrs,
        "num_warps": compile["num_warps"],
        "num_stages": compile["num_stages"],
        "num_ctas": compile["num_ctas"],
    }
    tag = json.dumps(rec, sort_keys=True)
    with _LOCK:
        _RECORDS[tag] = rec


def install(path: str) -> None:
    from triton import knobs

    knobs.runtime.jit_post_compile_hook = _hook

    def write():
        with _LOCK:
            rows = sorted(
                _RECORDS.values(),
                key=lambda r: (r["family"], r["kernel"], json.dumps(r, sort_keys=True)),
            )
        with open(path, "w") as f:
            json.dump({"launches": rows, "errors": _ERRORS}, f, indent=1)
            f.write("\n")

    atexit.register(write)

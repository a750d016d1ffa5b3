# SPDX-License-Identifier: Apache-2.0
"""sm_90 SASS of recorded launches, counted without a GPU: a kernel change's instruction budget
before device time is spent on it.

    python -m tests.aot.sass_count indexer _fused_kernel BLOCK=512 NB=64 BOUND=True +HIST_RELAXED=False

Arguments: the kernel's op family (``vllm_dsv4_hw.ops.triton.<family>``), its name,
then ``NAME=VALUE`` filters on the recorded constexprs and ``+NAME=VALUE`` knobs set on every
matching launch (Python literals). Launches come from ``launches-h200-native.json`` as the target
matrix compiles them (``compile_launches.for_backend`` / ``with_new_defaults``); one line per
distinct launch: total instructions, the length of each backward branch's loop, the most
frequent opcodes (``TOP``, default 12). ``SASS_DUMP=DIR`` also writes each launch's listing
without its addresses to ``DIR/<kernel>-<n>.sass`` (numbered in record order): a refactor meant
to change nothing diffs empty against the listings of the commit before it.

The divisibility attributes matter: the FP8 GEMV at 8 x 1,024 compiled without the recorded ones
has a 1,969-instruction loop (scalar loads, per-step shuffles), with them 378. The Triton that
compiles is the one imported; the GPUs here run Triton 3.6, whose lowering differs from this
machine's 3.9 (``tl.histogram`` is warp ballots in 3.6, shared-memory atomics in 3.9). For the
device's counts, put its wheel first on the path::

    pip download triton==3.6.0 --no-deps -d /tmp/t36
    pip install --no-deps --target /tmp/t36lib /tmp/t36/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36lib python -m tests.aot.sass_count linear _gemv_kernel BN=16 BK=512
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

RECORDS = Path(__file__).parent / "launches-h200-native.json"
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_args(argv: list[str]) -> tuple[str, str, dict, dict]:
    """module, kernel, filters {name: value}, knobs {name: value}."""
    if len(argv) < 2:
        raise SystemExit(__doc__)
    pairs = [a.lstrip("+").split("=", 1) for a in argv[2:]]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit("sass_count: filters and knobs are NAME=VALUE or +NAME=VALUE")
    filters = {n: _value(v) for a, (n, v) in zip(argv[2:], pairs) if not a.startswith("+")}
    knobs = {n: _value(v) for a, (n, v) in zip(argv[2:], pairs) if a.startswith("+")}
    return argv[0], argv[1], filters, knobs


def summarize(sass: str, top: int = 12) -> dict:
    """Instruction count, loop lengths (each backward branch's span) and opcode counts of one
    ``cuobjdump -sass`` listing."""
    ins = [
        (int(m.group(1), 16), m.group(2).strip()) for m in map(_ADDR.search, sass.splitlines()) if m
    ]
    ops = Counter()
    loops = []
    for addr, text in ins:
        body = re.sub(r"^@!?U?P\w+\s+", "", text)
        op = body.split()[0].split(".")[0] if body else ""
        ops[op] += 1
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", body)
        if target and int(target.group(1), 16) < addr:
            loops.append((addr - int(target.group(1), 16)) // 16 + 1)
    return {"instructions": len(ins), "loops": loops, "ops": ops.most_common(top)}


def main(argv: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    from tests.aot.compile_launches import compile_record, for_backend, kernel_fn, with_new_defaults

    module, kernel, filters, knobs = parse_args(argv)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    seen = set()
    for r in json.loads(RECORDS.read_text())["launches"]:
        if r["family"] != module or r["kernel"] != kernel:
            continue
        if any(r["constexprs"].get(n) != v for n, v in filters.items()):
            continue
        fn = kernel_fn(r)
        r = with_new_defaults(for_backend(r, "cuda", "90"), fn)
        r = dict(
            r,
            constexprs=dict(r["constexprs"], **knobs),
            signature=dict(r["signature"], **{k: "constexpr" for k in knobs}),
        )
        key = json.dumps([r["constexprs"], r["num_warps"], r["num_stages"]], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_record(r, GPUTarget("cuda", 90, 32))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run(
                [str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True
            ).stdout
        s = summarize(sass, int(os.environ.get("TOP", "12")))
        if os.environ.get("SASS_DUMP"):
            dump = Path(os.environ["SASS_DUMP"])
            dump.mkdir(parents=True, exist_ok=True)
            body = "\n".join(m.group(2).strip() for m in map(_ADDR.search, sass.splitlines()) if m)
            (dump / f"{kernel}-{len(seen)}.sass").write_text(key + "\n" + body + "\n")
        shown = {n: v for n, v in r["constexprs"].items() if n not in ("PDL",)}
        print(
            f"{kernel} {shown} warps {r['num_warps']} (Triton {triton.__version__}): "
            f"{s['instructions']} instructions, loops {s['loops']}, {s['ops']}"
        )
    if not seen:
        raise SystemExit(f"sass_count: no recorded launch of {module}.{kernel} matches {filters}")


if __name__ == "__main__":
    # the kernels must be JIT functions, not interpreted (set before any kernel module loads;
    # never on import: the test suite imports this module and runs under the interpreter)
    os.environ.pop("TRITON_INTERPRET", None)
    main(sys.argv[1:])

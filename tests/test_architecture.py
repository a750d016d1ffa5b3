# SPDX-License-Identifier: Apache-2.0
"""The package's structure as ``docs/architecture.md`` states it: the layer order of the import
graph (every import, top-level or inside a function), no import cycle inside ``ops/``, nothing of
the runtime package importing tests or benchmarks, and no module over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "vllm_dsv4_hw"

# Bottom up; a module may import its own layer and the layers below it. The first prefix that
# matches a module names its layer (docs/architecture.md, "Layers").
LAYERS = [
    (
        "settings",
        [
            "vllm_dsv4_hw",
            "vllm_dsv4_hw.envs",
            "vllm_dsv4_hw.kinds",
            "vllm_dsv4_hw.config",
            "vllm_dsv4_hw.quant.scheme",
            "vllm_dsv4_hw.platform",
        ],
    ),
    (
        "formats",
        [
            "vllm_dsv4_hw.numerics",
            "vllm_dsv4_hw.kv_cache",
            "vllm_dsv4_hw.quant.formats",
            "vllm_dsv4_hw.parallel",
        ],
    ),
    ("ops", ["vllm_dsv4_hw.ops"]),
    ("quant", ["vllm_dsv4_hw.quant"]),
    ("attention and model", ["vllm_dsv4_hw.attention", "vllm_dsv4_hw.model"]),
    ("engine", ["vllm_dsv4_hw.engine"]),
    (
        "tools, conformance, cli",
        [
            "vllm_dsv4_hw.tools",
            "vllm_dsv4_hw.conformance",
            "vllm_dsv4_hw.cli",
            "vllm_dsv4_hw.__main__",
        ],
    ),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / PKG).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ``modules`` (or outside name) that ``name`` imports, at any depth."""

    def resolve(dotted: str) -> str:
        probe = dotted
        while probe and probe not in modules:
            probe = probe.rpartition(".")[0]
        return probe or dotted

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in modules else resolve(base))
    found.discard(name)
    return found


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_imports_follow_the_layer_order():
    upward = []
    for module, deps in _graph().items():
        for dep in deps:
            if dep.startswith(PKG) and _layer(dep) > _layer(module):
                upward.append(
                    f"{module} ({LAYERS[_layer(module)][0]}) imports {dep} "
                    f"({LAYERS[_layer(dep)][0]})"
                )
    assert not upward, "\n".join(sorted(upward))


def test_the_runtime_package_imports_no_tests_or_benchmarks():
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _graph().items()
        for d in deps
        if d.split(".")[0] in ("tests", "benchmarks")
    )
    assert not bad, "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path back to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycle_inside_ops():
    graph = {
        m: {d for d in deps if d.startswith(f"{PKG}.ops")}
        for m, deps in _graph().items()
        if m.startswith(f"{PKG}.ops")
    }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_checks_find_what_they_look_for():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _layer(f"{PKG}.ops.api") > _layer(f"{PKG}.kv_cache.paged")
    assert _layer(f"{PKG}.quant.linear") > _layer(f"{PKG}.quant.formats")


def test_no_module_over_500_lines():
    long = sorted(
        f"{p.relative_to(ROOT)}: {n}"
        for folder in (PKG, "tests", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    )
    assert not long, "\n".join(long)


def test_every_source_file_names_its_license():
    tag = "SPDX-License-Identifier: Apache-2.0"
    missing = sorted(
        str(p.relative_to(ROOT))
        for folder in (PKG, "tests", "benchmarks", "scripts")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".sh") and tag not in "".join(p.read_text().splitlines(True)[:2])
    )
    assert not missing, f"no '{tag}' in the first two lines: {missing}"

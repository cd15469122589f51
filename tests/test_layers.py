"""The layers (docs/architecture.md), checked on the source: no import circle, nothing imports
upward, and functions fit on a screen. Function-local imports count: hiding an import inside a
function does not remove the dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "deployments", "cluster")
MAX_FUNCTION_LINES = 60
LONG_OK = "# long:"  # a function over the limit says why, in a comment with this prefix


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, anywhere in the file."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # the deepest project module it names
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None. Importing a package's submodule runs the package's
    ``__init__`` first, but that is not an edge back: only what a module imports is."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# The library's layers, bottom up (docs/architecture.md): a module imports only from its own
# layer or the ones below it.
LAYERS = [
    ("base", ["specdec", "specdec.paths", "specdec.sampling", "specdec.verify", "specdec.stats", "specdec.config",
              "specdec.text", "specdec.plugins", "specdec.hardware", "specdec.trees"]),
    ("tracing", ["specdec.telemetry", "specdec.tracing"]),
    ("models", ["specdec.models", "specdec.loading"]),
    ("the batched pass", ["specdec.batch"]),
    ("drafters", ["specdec.drafters"]),
    ("engine", ["specdec.policy", "specdec.engine"]),
    ("tools", ["specdec.demo", "specdec.bench", "specdec.cli"]),
]


def _layer(module: str) -> int | None:
    """The index of ``module``'s layer (the longest matching prefix), None outside the library."""
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _under(module, prefix) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports inside the library from a lower layer to a higher one."""
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))


def test_no_import_circle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_layer_imports_a_layer_above_it():
    """specdec (the library) never imports deployments (the Serve layer) or cluster; the models
    never import the demo (which builds them); nothing below the demo, the bench and the CLI
    imports them."""
    graph = _graph()
    upward = []
    for module, targets in graph.items():
        for target in targets:
            if _under(module, "specdec") and (_under(target, "deployments") or _under(target, "cluster")):
                upward.append((module, target))
            top = {"specdec.demo", "specdec.bench", "specdec.cli"}
            if _under(module, "specdec") and not any(_under(module, t) for t in top):
                if any(_under(target, t) for t in top):
                    upward.append((module, target))
    assert not upward, upward


def test_every_library_module_has_a_layer_and_imports_only_downward():
    graph = _graph()
    unplaced = [m for m in graph if _under(m, "specdec") and _layer(m) is None]
    assert not unplaced, unplaced
    assert not _upward(graph), _upward(graph)


def test_no_library_module_is_imported_only_by_tests():
    """Every module under specdec/ is imported by the project itself (its scripts included) or
    is an entry point: the console script, or a module run with ``python -m``."""
    graph, modules = _graph(), _modules()
    used = {t for targets in graph.values() for t in targets} | {"specdec.cli"}  # [project.scripts]
    for path in (ROOT / "scripts").glob("*.py"):
        used |= _imports(path, f"scripts.{path.stem}", set(graph))
    unused = [m for m, path in modules.items() if _under(m, "specdec") and m not in used
              and path.name != "__init__.py" and '__name__ == "__main__"' not in path.read_text()]
    assert not unused, unused


def test_functions_fit_on_a_screen():
    long = []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                body = lines[node.lineno - 1: node.end_lineno]
                if size > MAX_FUNCTION_LINES and not any(LONG_OK in line for line in body):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines)")
    assert not long, long


def test_the_checks_see_a_circle_and_an_upward_import():
    """The negative control: a planted circle and an upward edge are found."""
    graph = {"specdec.a": {"specdec.b"}, "specdec.b": {"specdec.a"}}
    assert _cycle(graph) == ["specdec.a", "specdec.b", "specdec.a"]
    assert _cycle({"specdec.a": {"specdec.b"}, "specdec.b": set()}) is None
    known = set(_modules())
    source = ROOT / "specdec" / "engine" / "__init__.py"
    assert "specdec.engine.loop" in _imports(source, "specdec.engine", known)
    # a drafter importing the step loop runs up a layer; the engine importing a drafter does not
    assert _upward({"specdec.drafters.model": {"specdec.engine.loop"}}) == [("specdec.drafters.model",
                                                                           "specdec.engine.loop")]
    assert _upward({"specdec.engine.loop": {"specdec.drafters.model"}}) == []


def test_no_file_cites_notes_outside_the_repo():
    """DESIGN.md and STYLE.md were working notes a clone never sees: cite docs/ instead."""
    cited = []
    for path in [*ROOT.glob("specdec/**/*.py"), *ROOT.glob("deployments/*.py"), *ROOT.glob("tests/*.py"),
                 *ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("cluster/*")]:
        if path.is_file() and path.name != Path(__file__).name:
            text = path.read_text(errors="replace")
            cited += [str(path.relative_to(ROOT)) for n in ("DESIGN.md", "STYLE.md", "BATCHING.md") if n in text]
    assert not cited, cited

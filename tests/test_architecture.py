"""The shape of the core, as docs/architecture.md describes it: no import circle, a loop small enough to read in
one sitting, functions short enough to read at a glance, and features that are plugins the core never names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gyremedia"
#: Policies, objectives and the tiny-model builders sit beside the core (docs/architecture.md); first-party plugins
#: live in plugins/.
NOT_CORE = ("backbones", "objectives", "tiny")
FEATURES = ("candidates", "pareto", "prompt_history", "forward_reuse", "monitor")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module of the package ``path`` imports anywhere: at the top, in functions and under TYPE_CHECKING."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # importing a package's own parent runs only its __init__, which imports nothing of ours
            if target and target != name and not name.startswith(f"{target}."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 30 and "gyremedia.stages.update" in graph["gyremedia.stages"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def core_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in NOT_CORE]


def test_the_loop_reads_in_one_sitting():
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) < 250


def test_no_core_function_is_longer_than_sixty_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in core_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60
    ]
    assert not long, long


def test_the_core_imports_no_plugin_and_the_loop_names_no_feature():
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for path in core_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert "gyremedia.stages.update" in imported
    assert not [name for name in imported if name.startswith("gyremedia_")]  # first-party plugins included
    trainer = (PACKAGE / "trainer.py").read_text().split('"""', 2)[2]  # its docstring lists them for the reader
    assert not [
        word for word in ("candidate", "pareto", "preference", "history", "monitor", "keep_forwards") if word in trainer
    ]


def test_every_feature_is_a_plugin_registered_as_a_third_partys():
    text = (ROOT / "pyproject.toml").read_text()
    for feature in FEATURES:
        assert f'{feature} = "gyremedia_features.{feature}"' in text


def test_no_core_file_names_a_policy_family():
    """The masked-diffusion LMs came in as a plugin: the loop and the core name no family."""
    family = re.compile(r"masked_diffusion|dllm|diffusion_lm|causal_lm", re.I)
    named = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in core_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if family.search(line)
    ]
    assert not named, named

"""The engine's shape, read from the source (as tests/test_draft_protocol.py reads the family
rule): the scheduler decides and calls nothing of the engine, and one function runs the target
forward of a decode step, for chains and trees, on every device (serve/engine/step.py)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "serve" / "engine"
FORWARDS = {"forward_batch", "forward", "forward_features", "forward_masked", "forward_static", "forward_rows",
            "prefill", "tree_step"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_scheduler_imports_nothing_of_the_engine_or_the_model_and_holds_no_engine():
    path = ENGINE / "scheduler.py"
    assert not {m for m in _imports(path) if m in ("serve.engine.core", "serve.engine.step") or m.startswith("serve.model")}
    names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    assert "engine" not in names | attrs


def _forward_calls(path: Path) -> list[tuple[str, str]]:
    """(enclosing function, called name) for every call of a target forward in the module."""
    found = []

    class Visit(ast.NodeVisitor):
        def __init__(self):
            self.fn = ["<module>"]

        def visit_FunctionDef(self, node):
            self.fn.append(node.name)
            self.generic_visit(node)
            self.fn.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in FORWARDS:
                found.append((self.fn[-1], name))
            self.generic_visit(node)

    Visit().visit(ast.parse(path.read_text()))
    return found


def test_one_function_runs_the_target_forward_of_a_decode_step():
    """Every decode step's target forward is run_step's one forward_batch call; the engine's
    only other forwards are the cost profile's, over scratch caches."""
    calls = {p.name: _forward_calls(p) for p in sorted(ENGINE.glob("*.py"))}
    calls["trees/stages.py"] = _forward_calls(ROOT / "serve" / "spec_decode" / "trees" / "stages.py")
    assert calls.pop("step.py") == [("run_step", "forward_batch")]
    assert {fn for fn, _ in calls.pop("core.py")} <= {"_profile_forward", "forward"}
    assert all(not c for c in calls.values()), calls

"""Meta-test: every hook is documented in hookspecs.py and docs/plugins.md, and exercised by a test."""

import inspect
from pathlib import Path

import pytest

from gyremedia import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("gyremedia_")]
TEST_SOURCES = {p: p.read_text() for p in Path(__file__).parent.rglob("*.py") if p.name != Path(__file__).name}


def test_hooks_are_found():
    assert len(HOOKS) >= 15


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and len(doc) > 20, f"{hook} needs a docstring in gyremedia/hookspecs.py"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_in_the_plugin_docs(hook):
    assert f"`{hook}" in (ROOT / "docs" / "plugins.md").read_text(), f"document {hook} in docs/plugins.md"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook):
    users = [p.name for p, text in TEST_SOURCES.items() if hook in text]
    assert users, f"no test implements or calls {hook}"

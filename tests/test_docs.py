"""The documentation's code runs: docs/plugins.md's "write your own reward in 10 lines"."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def snippet(heading: str) -> str:
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_write_your_own_reward_snippet_trains(make_config, tmp_path):
    code = snippet("## Write your own reward in 10 lines")
    statements = [
        line
        for line in code.splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "@", "from", "import"))
    ]
    assert len(statements) <= 10, statements
    path = tmp_path / "my_rewards.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("my_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pm = PluginManager(extra_plugins=[module])
    config = make_config("rewards.0.name=brightness", "rewards.0.target=0.3", "train.steps=1", plugins=pm)
    state = Trainer(config, pm).train()
    assert state.rewards["brightness"].target == 0.3
    assert "reward/brightness" in state.last_metrics


def test_every_registered_objective_has_its_section_in_docs_objectives(plugin_manager):
    text = (ROOT / "docs" / "objectives.md").read_text()
    names = [c.name for c in plugin_manager.registry.all() if c.kind == "objective"]
    assert len(names) >= 13
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/objectives.md does not describe {missing}"

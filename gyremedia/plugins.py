"""Plugin discovery: the plugin manager that loads entry points and relays hooks.

Plugins are modules listed under the entry-point group ``gyremedia`` (ours in ``plugins/`` and
third parties' alike). Loading one never changes a run: registration hooks only add named
components, and the yaml selects which ones run.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import traceback
from typing import Any, Callable, Iterable

import pluggy

from gyremedia import hookspecs, stages
from gyremedia.registry import (  # noqa: F401 - re-exported: the names plugins and tests import from here
    ALLOW_LIST_ENV,
    CAPABILITIES,
    COMPONENT_KINDS,
    DATA_CHANGING_HOOKS,
    Component,
    FailedPlugin,
    PluginError,
    Registry,
    call_each,
    read_capabilities,
)

ENTRY_POINT_GROUP = "gyremedia"
#: The plugin holding the stage hooks' default implementations (the package gyremedia/stages/).
ESSENTIAL_PLUGIN = "gyremedia.stages"


class PluginManager:
    """Loads entry-point plugins, collects their registrations and relays lifecycle hooks."""

    def __init__(self, extra_plugins: Iterable[Any] = (), load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.failed: list[FailedPlugin] = []
        self.distributions: dict[str, str] = {}
        # The stages' default implementations load always, whatever GYREMEDIA_PLUGINS allows.
        self.pm.register(stages, name=ESSENTIAL_PLUGIN)
        self.distributions[ESSENTIAL_PLUGIN] = "gyremedia"
        if load_entry_points:
            self._load_entry_points()
        for plugin in extra_plugins:  # plugin state in checkpoints is keyed by this stable name
            self.register_module(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__name__)
        self.registry = self._collect_registrations()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def _load_entry_points(self) -> None:
        allow = os.environ.get(ALLOW_LIST_ENV)
        allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            if self.pm.has_plugin(ep.name):
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
                self.register_module(module, name=ep.name)
            except Exception as exc:  # a broken third-party plugin must not break unrelated runs
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.failed.append(FailedPlugin(ep.name, dist, error))
                continue
            self.distributions[ep.name] = dist

    def register_module(self, module: Any, name: str | None = None) -> None:
        """Register a plugin module or object whose hooks are not data-changing."""
        data_changing = sorted(h for h in DATA_CHANGING_HOOKS if hasattr(module, h))
        if data_changing:
            raise PluginError(
                f"plugin {name!r} implements {', '.join(data_changing)} at module level, which would "
                "change every run once installed. Implement it on a reward or regularizer object, or on an object "
                "that a gyremedia_setup hook registers (PluginManager.register_for_run) when the config turns the "
                "feature on, so it runs only when the yaml asks for it."
            )
        self.pm.register(module, name=name)

    def register_component(self, component: Any, name: str) -> None:
        """Register a run's selected component object so its lifecycle hooks are called."""
        if any(
            self.pm.parse_hookimpl_opts(component, attr) for attr in dir(component) if attr.startswith("gyremedia_")
        ):
            unique, copies = name, 1
            while self.pm.has_plugin(unique):  # e.g. the same sampler selected for training and eval
                copies += 1
                unique = f"{name}#{copies}"
            self.pm.register(component, name=unique)

    def register_for_run(self, plugin: Any, name: str) -> None:
        """Register a feature's per-run object (from ``gyremedia_setup``), replacing the one an earlier run in
        this process registered under ``name``."""
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self.pm.register(plugin, name=name)

    def _collect_registrations(self) -> Registry:
        registry = Registry()
        for kind, hook_name in COMPONENT_KINDS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in reversed(hook.get_hookimpls()):

                def register(
                    name: str,
                    factory: Callable[..., Any],
                    *,
                    options: type | None = None,
                    _plugin: str = impl.plugin_name,
                    _kind: str = kind,
                    **meta: Any,
                ) -> None:
                    if options is not None and not dataclasses.is_dataclass(options):
                        raise PluginError(f"{_kind} {name!r} from {_plugin!r}: options must be a dataclass")
                    capabilities = read_capabilities(_kind, name, _plugin, factory, meta)
                    registry.add(Component(_kind, name, factory, options, _plugin, capabilities))

                impl.function(register)
        return registry

    def component(self, kind: str, name: str) -> Component:
        return self.registry.get(kind, name, self.failed)

    def build(self, selected: Any, context: Any) -> Any:
        """Build a config-selected component and register it so its lifecycle hooks are called."""
        component = self.component(selected.kind, selected.component).build(selected.options, context)
        self.register_component(component, name=f"{selected.kind}:{selected.name}")
        return component

    def describe(self) -> list[dict[str, Any]]:
        """One entry per plugin: its package, what it registers and the lifecycle hooks it implements."""
        rows = []
        for plugin_name, plugin in self.pm.list_name_plugin():
            if plugin_name is None:
                continue
            hooks = sorted(
                impl.name
                for impl in self.pm.get_hookcallers(plugin) or []
                if not impl.name.startswith("gyremedia_register_")
            )
            registers = sorted(f"{c.kind}:{c.name}" for c in self.registry.all() if c.plugin == plugin_name)
            rows.append(
                {
                    "plugin": plugin_name,
                    "package": self.distributions.get(plugin_name, "(local)"),
                    "registers": registers,
                    "hooks": hooks,
                }
            )
        return sorted(rows, key=lambda r: r["plugin"])

"""Plugin discovery and the component registries.

Plugins are modules listed under the entry-point group ``gyremedia`` (ours in ``plugins/`` and
third parties' alike). Loading one never changes a run: registration hooks only add named
components, and the yaml selects which ones run.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from gyremedia import hookspecs
from gyremedia.hookspecs import COMPONENT_KINDS, DATA_CHANGING_HOOKS

ENTRY_POINT_GROUP = "gyremedia"
#: Comma-separated entry-point names; when set, only these plugins load.
ALLOW_LIST_ENV = "GYREMEDIA_PLUGINS"
#: The plugin holding the stage hooks' default implementations (gyremedia/stages.py).
ESSENTIAL_PLUGIN = "gyremedia.stages"


class PluginError(Exception):
    """A plugin could not be loaded or a component name is unknown."""

    exit_code = 2


@dataclass(frozen=True)
class Component:
    """One registered component: how to build it and who registered it."""

    kind: str
    name: str
    factory: Callable[..., Any]
    options: type | None
    plugin: str
    meta: dict[str, Any] = field(default_factory=dict)

    def build(self, options: Any, context: Any) -> Any:
        """Build the component from its validated options (an instance of ``self.options``).

        Factories take ``(options, context)``, or only ``(context)`` when they registered no options.
        """
        if self.options is None:
            return self.factory(context)
        return self.factory(options, context)


@dataclass(frozen=True)
class FailedPlugin:
    """An entry point whose import raised; reported by name instead of crashing every run."""

    name: str
    distribution: str
    error: str


def call_each(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> dict[str, Any]:
    """Call each implementation of a hook separately and return ``{plugin_name: result}``.

    Used where the caller needs to know which plugin said what (registration, checkpoint state).
    """
    hook = getattr(pm.hook, hook_name)
    results = {}
    for impl in reversed(hook.get_hookimpls()):  # registration order
        args = [kwargs[name] for name in impl.argnames]
        results[impl.plugin_name] = impl.function(*args)
    return results


#: What a component of each kind may declare about itself, as class attributes, with the default
#: when it declares nothing. The config reads them to refuse impossible combinations before any model loads.
CAPABILITIES: dict[str, dict[str, Any]] = {
    # transitions: "denoising" (sampler steps of a state) or "tokens" (a token policy samples itself)
    # shardable: every process runs the same model calls in a step, as FSDP's collectives need
    # compilable: compile() compiles its networks in place (train.compile)
    "backbone": {"media_kind": None, "prediction": None, "transitions": "denoising", "shardable": False,
                 "compilable": False},
    "sampler": {"has_log_prob": False, "needs_predict": False, "prediction": None},
    # kl_regularizer: the regularizer an objective's `kl_beta` option selects (with that weight)
    # needs_tree_rollouts: it trains on tree rollouts (rollout.branch_steps)
    # plans_transitions: planned_transitions(stochastic, step) names the transitions it will replay before the
    # rollout is sampled, among the stochastic ones (train.reuse_rollout_forward)
    "objective": {"requires_log_prob": False, "default_weighting": None, "kl_regularizer": None,
                  "needs_tree_rollouts": False, "plans_transitions": False,
                  "transitions": None},  # transitions: what it trains (None: any)
    "reward": {"kinds": None},  # the media kinds it scores
    "regularizer": {"requires_log_prob": False, "transitions": None},
    "weighting": {},
    "logger": {},
}


def read_capabilities(kind: str, name: str, plugin: str, factory: Any, given: dict[str, Any]) -> dict[str, Any]:
    """A component's capabilities: the class attributes of ``factory`` (a factory that is not a class may
    pass them to ``register``). Unknown keys, and a value given twice that disagrees, are errors."""
    known = CAPABILITIES[kind]
    where = f"{kind} {name!r} from {plugin!r}"
    unknown = sorted(k for k in given if k not in known and k != "description")
    if unknown:
        hints = [f"{k} (did you mean {difflib.get_close_matches(k, list(known), n=1)[0]}?)"
                 if difflib.get_close_matches(k, list(known), n=1) else k for k in unknown]
        allowed = ", ".join(known) or "none"
        raise PluginError(f"{where}: unknown register() keys {', '.join(hints)}; a {kind} declares {allowed} "
                          "as class attributes")
    meta: dict[str, Any] = {"description": given.get("description", "")}
    for key, default in known.items():
        declared = getattr(factory, key, default) if isinstance(factory, type) else default
        if key in given:
            if isinstance(factory, type) and hasattr(factory, key) and getattr(factory, key) != given[key]:
                raise PluginError(f"{where}: register({key}={given[key]!r}) disagrees with the class's "
                                  f"{key} = {getattr(factory, key)!r}: declare it once, on the class")
            declared = given[key]
        meta[key] = declared
    return meta


class Registry:
    """All components registered by all plugins, by kind and name."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in COMPONENT_KINDS}

    def add(self, component: Component) -> None:
        existing = self._components[component.kind].get(component.name)
        if existing is not None:
            raise PluginError(
                f"{component.kind} {component.name!r} is registered twice: by plugin "
                f"{existing.plugin!r} and by plugin {component.plugin!r}. Uninstall one, or restrict "
                f"plugins with {ALLOW_LIST_ENV}=name1,name2."
            )
        self._components[component.kind][component.name] = component

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def all(self) -> Iterable[Component]:
        for by_name in self._components.values():
            yield from by_name.values()

    def get(self, kind: str, name: str, failed: Iterable[FailedPlugin] = ()) -> Component:
        """Return a component or raise an error listing the registered names and broken plugins."""
        try:
            return self._components[kind][name]
        except KeyError:
            pass
        known = self.names(kind)
        message = f"unknown {kind} {name!r}. Registered {kind}s: {', '.join(known) or '(none)'}."
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f" Did you mean {close[0]!r}?"
        broken = [f"{p.name} (package {p.distribution}): {p.error}" for p in failed]
        if broken:
            message += " These plugins failed to load and may provide it: " + "; ".join(broken)
        raise PluginError(message)


class PluginManager:
    """Loads entry-point plugins, collects their registrations and relays lifecycle hooks."""

    def __init__(self, extra_plugins: Iterable[Any] = (), load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.failed: list[FailedPlugin] = []
        self.distributions: dict[str, str] = {}
        from gyremedia import stages

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
                "change every run once installed. Implement it on a reward or regularizer object "
                "instead, so it runs only when the yaml selects that component."
            )
        self.pm.register(module, name=name)

    def register_component(self, component: Any, name: str) -> None:
        """Register a run's selected component object so its lifecycle hooks are called."""
        if any(self.pm.parse_hookimpl_opts(component, attr) for attr in dir(component)
               if attr.startswith("gyremedia_")):
            unique, copies = name, 1
            while self.pm.has_plugin(unique):  # e.g. the same sampler selected for training and eval
                copies += 1
                unique = f"{name}#{copies}"
            self.pm.register(component, name=unique)

    def _collect_registrations(self) -> Registry:
        registry = Registry()
        for kind, hook_name in COMPONENT_KINDS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in reversed(hook.get_hookimpls()):

                def register(name: str, factory: Callable[..., Any], *, options: type | None = None,
                             _plugin: str = impl.plugin_name, _kind: str = kind, **meta: Any) -> None:
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
                impl.name for impl in self.pm.get_hookcallers(plugin) or []
                if not impl.name.startswith("gyremedia_register_")
            )
            registers = sorted(
                f"{c.kind}:{c.name}" for c in self.registry.all() if c.plugin == plugin_name
            )
            rows.append({
                "plugin": plugin_name,
                "package": self.distributions.get(plugin_name, "(local)"),
                "registers": registers,
                "hooks": hooks,
            })
        return sorted(rows, key=lambda r: r["plugin"])

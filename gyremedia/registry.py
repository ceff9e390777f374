"""The component registry: what a plugin registers, what each kind may declare, and lookup by name.

Below the plugin manager, the config and the hooks: it imports none of them, so the config can check
names and capabilities against it without an import circle.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

#: Comma-separated entry-point names; when set, only these plugins load.
ALLOW_LIST_ENV = "GYREMEDIA_PLUGINS"

#: Hooks that change the data a run trains on; only config-selected components implement them.
#: A stage that changes them (scoring, advantages, the update) is one too; the rollout stage is not, so that an
#: installed inference engine can sample the same policy for every run.
DATA_CHANGING_HOOKS = frozenset(
    {
        "gyremedia_after_rollout",
        "gyremedia_process_rewards",
        "gyremedia_prepare_request",
        "gyremedia_group_statistics",
        "gyremedia_score_rollout",
        "gyremedia_compute_advantages",
        "gyremedia_update",
    }
)

#: The component kinds and the registration hook of each.
COMPONENT_KINDS = {
    "backbone": "gyremedia_register_backbones",
    "sampler": "gyremedia_register_samplers",
    "objective": "gyremedia_register_objectives",
    "reward": "gyremedia_register_rewards",
    "regularizer": "gyremedia_register_regularizers",
    "weighting": "gyremedia_register_weightings",
    "logger": "gyremedia_register_loggers",
}


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


#: What a component of each kind may declare about itself, as class attributes, with the default
#: when it declares nothing. The config reads them to refuse impossible combinations before any model loads.
CAPABILITIES: dict[str, dict[str, Any]] = {
    # transitions: "denoising" (sampler steps of a state) or "tokens" (a token policy samples itself)
    # shardable: every process runs the same model calls in a step, as FSDP's collectives need
    # compilable: compile() compiles its networks in place (train.compile)
    # prefetches: prefetch(prompts) starts preparing the next step's prompts while this step trains
    # frame_dim: the axis of its states that indexes video frames (per-frame advantages broadcast along it)
    # replays_steps: a token policy that decodes in steps: step_log_probs(rollout, steps), step_media(rollout,
    # rows, steps) (one-step predictions) and rollout.extras["step_entropy"] [B, K]
    "backbone": {
        "frame_dim": None,
        "media_kind": None,
        "prediction": None,
        "transitions": "denoising",
        "shardable": False,
        "compilable": False,
        "prefetches": False,
        "replays_steps": False,
    },
    "sampler": {"has_log_prob": False, "needs_predict": False, "prediction": None},
    # kl_regularizer: the regularizer an objective's `kl_beta` option selects (with that weight)
    # needs_tree_rollouts: it trains on tree rollouts (rollout.branch_steps)
    # plans_transitions: planned_transitions(stochastic, step) names the transitions it will replay before the
    # rollout is sampled, among the stochastic ones (train.reuse_rollout_forward)
    # prepares: prepare(ctx, rollout) runs once per rollout before its first update
    # needs_reference: the backbone keeps the frozen reference policy (as for a regularizer)
    # per_frame: its loss weights each video frame by its own advantage (advantage.per_frame)
    "objective": {
        "per_frame": False,
        "needs_reference": False,
        "prepares": False,
        "requires_log_prob": False,
        "default_weighting": None,
        "kl_regularizer": None,
        "needs_tree_rollouts": False,
        "plans_transitions": False,
        "transitions": None,
    },  # transitions: what it trains (None: any)
    # differentiable: input_gradient(media, prompts) gives d score / d media (spatial credit's map)
    # frame_scores: it reports each video frame's score too (the component 'frames', [B, T])
    "reward": {"kinds": None, "differentiable": False, "frame_scores": False},  # kinds: the media kinds it scores
    "regularizer": {"requires_log_prob": False, "transitions": None, "needs_reference": False},
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
        hints = [
            f"{k} (did you mean {difflib.get_close_matches(k, list(known), n=1)[0]}?)"
            if difflib.get_close_matches(k, list(known), n=1)
            else k
            for k in unknown
        ]
        allowed = ", ".join(known) or "none"
        raise PluginError(
            f"{where}: unknown register() keys {', '.join(hints)}; a {kind} declares {allowed} as class attributes"
        )
    meta: dict[str, Any] = {"description": given.get("description", "")}
    for key, default in known.items():
        declared = getattr(factory, key, default) if isinstance(factory, type) else default
        if key in given:
            if isinstance(factory, type) and hasattr(factory, key) and getattr(factory, key) != given[key]:
                raise PluginError(
                    f"{where}: register({key}={given[key]!r}) disagrees with the class's "
                    f"{key} = {getattr(factory, key)!r}: declare it once, on the class"
                )
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


def call_each(pm: Any, hook_name: str, **kwargs: Any) -> dict[str, Any]:
    """Call each implementation of a hook separately and return ``{plugin_name: result}``.

    Used where the caller needs to know which plugin said what (registration, checkpoint state).
    """
    hook = getattr(pm.hook, hook_name)
    results = {}
    for impl in reversed(hook.get_hookimpls()):  # registration order
        args = [kwargs[name] for name in impl.argnames]
        results[impl.plugin_name] = impl.function(*args)
    return results


class PluginHost(Protocol):
    """What the config and the stages use of :class:`gyremedia.plugins.PluginManager` (typed here, below both)."""

    pm: Any  # the pluggy manager
    registry: Registry

    @property
    def hook(self) -> Any: ...

    def component(self, kind: str, name: str) -> Component: ...

    def build(self, selected: Any, context: Any) -> Any: ...

    def register_module(self, module: Any, name: str | None = None) -> None: ...

    def register_for_run(self, plugin: Any, name: str) -> None: ...

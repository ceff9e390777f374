"""Config is the interface: one yaml plus ``key=value`` overrides, validated before any model loads.

The core sections are omegaconf structured dataclasses. The component sections (``backbone``,
``sampler``, ``objective``, ``rewards``, ``regularizers``, ``logging.loggers``) hold a ``name`` and
that component's options, validated against the options dataclass its plugin registered.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gyremedia.plugins import PluginError, PluginManager


def asset_path(relative: str) -> str:
    """Absolute path of a file shipped in the repository's ``assets/`` folder (``gyremedia.assets``)."""
    from importlib import resources

    return str(resources.files("gyremedia.assets") / relative)


if not OmegaConf.has_resolver("asset"):
    # `${asset:shapes16/model}` in a yaml points into assets/, wherever gyremedia is installed.
    OmegaConf.register_resolver("asset", asset_path)


class ConfigError(ValueError):
    """The config is invalid; the message names each offending key and how to fix it."""


@dataclass
class RunSection:
    output_dir: str = "runs/default"
    seed: int = 0


@dataclass
class DataSection:
    prompts: list[str] = field(default_factory=list)
    prompts_file: str | None = None  # one prompt per line; added to ``prompts``
    eval_prompts: list[str] = field(default_factory=list)


@dataclass
class RolloutSection:
    batch_size: int = 8  # samples per step over all processes
    group_size: int = 4  # samples per prompt; advantages are normalised within a group
    num_steps: int = 10  # denoising steps per sample
    guidance_scale: float = 1.0
    same_noise_in_group: bool = False  # every member of a group starts from the same noise
    # Score rollout k in worker threads while rollout k+1 is sampled. Each rollout is then trained
    # one optimizer step after the policy that sampled it (the ratio objectives' clip covers that).
    async_scoring: bool = False
    # Tree rollouts (TreeGRPO): a group's samples share one trajectory and split into `branch_width`
    # children at each of these step indices; group_size must be branch_width ** len(branch_steps).
    branch_steps: list[int] = field(default_factory=list)
    branch_width: int = 2


@dataclass
class TrainSection:
    steps: int = 100
    learning_rate: float = 1e-4
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    num_minibatches: int = 1  # optimizer steps per rollout; each one takes a slice of the samples


@dataclass
class AdvantageSection:
    std: str = "group"  # group | global | none: what the centred reward is divided by
    eps: float = 1e-4
    # How several rewards become one advantage: "sum" normalises the weighted sum of the rewards;
    # "normalize_each" normalises each reward within its groups, then sums the weighted advantages
    # (a reward with a large scale cannot drown the others).
    combine: str = "sum"


@dataclass
class ParetoSection:
    """ParetoSlider: one model conditioned on reward-preference weights instead of a fixed weighted sum."""

    enabled: bool = False  # needs >= 2 rewards and a backbone with preference_inputs = their number
    concentration: float = 1.0  # Dirichlet alpha of the weight vector drawn per prompt group (1: uniform on the simplex)
    sweep: int = 5  # weight settings evaluated after training (the front; two rewards: (1, 0) ... (0, 1))


@dataclass
class MonitorSection:
    """Reward-hacking monitor (gyremedia/monitor.py); ``monitor.gold`` lists held-out rewards like ``rewards``."""

    tolerance: float = 0.005  # changes of eval means smaller than this count as flat
    min_diversity: float = 0.5  # warn when in-group diversity falls below this share of the first eval's
    drift: bool = False  # measure the velocity drift from the reference at each eval (keeps the reference)
    drift_levels: int = 3  # noise levels the drift is measured at


@dataclass
class CheckpointSection:
    every: int = 10  # steps between checkpoints (the last step is always saved)
    keep_last: int = 2


@dataclass
class EvalSection:
    every: int = 0  # steps between evaluations; 0 evaluates only before and after training
    prompts_file: str | None = None  # held-out prompts (default: data.eval_prompts, else the train prompts)
    samples: int = 256  # samples per evaluation, prompts cycled; the same seeds every time
    seed: int = 1234
    num_steps: int | None = None  # denoising steps (default: rollout.num_steps)
    metric: str | None = None  # "<reward>/<component>" reported as accuracy (default: the first reward's score)
    grid_size: int = 16  # samples shown in the before/after grids


@dataclass
class ExportSection:
    on_train_end: bool = True  # write RUN_DIR/pipeline, a folder the backbone library's stock loader reads
    merge_lora: bool = True  # merge LoRA adapters into the weights (else save the adapters alone)


@dataclass
class LoggingSection:
    loggers: list[Any] = field(default_factory=list)  # names, or {name: ..., option: ...}
    progress: bool = True


@dataclass
class TrainConfig:
    """The core sections. The component sections (see ``COMPONENT_SECTIONS``) sit beside them."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    pareto: ParetoSection = field(default_factory=ParetoSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    export: ExportSection = field(default_factory=ExportSection)
    logging: LoggingSection = field(default_factory=LoggingSection)


#: Component sections: config path -> (component kind, whether it is a list).
COMPONENT_SECTIONS = {
    "backbone": ("backbone", False),
    "sampler": ("sampler", False),
    "objective": ("objective", False),
    "rewards": ("reward", True),
    "regularizers": ("regularizer", True),
    "weighting": ("weighting", False),
    "logging.loggers": ("logger", True),
    "eval.sampler": ("sampler", False),
    "monitor.gold": ("reward", True),
}
#: Component sections a config may leave out (``eval.sampler`` defaults to the run's sampler).
#: (``weighting`` defaults to the objective's ``default_weighting``, if it uses one).
OPTIONAL_SECTIONS = {"regularizers": [], "logging.loggers": [], "eval.sampler": None, "weighting": None,
                     "monitor.gold": []}


@dataclass
class RewardSettings:
    """Keys every reward accepts besides its own options."""

    weight: float = 1.0
    # What a failing sample does: "fail" stops the run naming the reward, step and prompt; "drop"
    # removes the sample from its group (advantage 0, excluded from the group's statistics) and
    # counts it in the metric reward/<name>/dropped. A failure is an exception or a timeout (the
    # whole call's samples) or a NaN/inf score (that sample).
    on_failure: str = "fail"
    timeout: float = 0.0  # seconds one call may take before it counts as failed; 0 waits forever


@dataclass
class RegularizerSettings:
    """Keys every regularizer accepts besides its own options."""

    weight: float = 1.0


#: Settings dataclass of the keys a list component accepts besides its own options.
COMPONENT_SETTINGS: dict[str, type] = {"reward": RewardSettings, "regularizer": RegularizerSettings}


@dataclass
class Selected:
    """A component chosen by the config, with its validated options."""

    kind: str
    name: str
    options: Any  # instance of the plugin's options dataclass, or None
    settings: Any = None  # instance of COMPONENT_SETTINGS[kind] (weight, failure policy, ...), or None
    meta: dict[str, Any] = field(default_factory=dict)  # what the plugin registered beside the factory

    @property
    def weight(self) -> float:
        return self.settings.weight if self.settings is not None else 1.0

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name}
        if self.settings is not None:
            body.update(dataclasses.asdict(self.settings))
        if self.options is not None:
            body.update(dataclasses.asdict(self.options))
        return body


@dataclass
class ResolvedConfig:
    """A validated run config: the core sections plus every selected component."""

    core: TrainConfig
    backbone: Selected
    sampler: Selected
    objective: Selected
    rewards: list[Selected]
    regularizers: list[Selected]
    loggers: list[Selected]
    eval_sampler: Selected | None = None
    weighting: Selected | None = None  # timestep weighting of an ELBO-family objective
    gold_rewards: list[Selected] = field(default_factory=list)  # monitor.gold: scored at evals, never trained on

    def to_yaml(self) -> str:
        """The fully resolved config (every default filled in), as written into the run folder."""
        data: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(self.core), resolve=True)
        for attr in ("backbone", "sampler", "objective"):
            data[attr] = getattr(self, attr).as_dict()
        data["rewards"] = [s.as_dict() for s in self.rewards]
        data["regularizers"] = [s.as_dict() for s in self.regularizers]
        if self.weighting is not None:
            data["weighting"] = self.weighting.as_dict()
        data["monitor"]["gold"] = [s.as_dict() for s in self.gold_rewards]
        data["logging"]["loggers"] = [s.as_dict() for s in self.loggers]
        if self.eval_sampler is not None:
            data["eval"]["sampler"] = self.eval_sampler.as_dict()
        return OmegaConf.to_yaml(data)


# --------------------------------------------------------------------------- key checking


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _unknown_key_errors(user: Any, schema: type, prefix: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """Errors for keys of ``user`` that ``schema`` lacks, with a did-you-mean, recursing into sections.

    ``allowed`` holds dotted paths accepted besides the schema's fields (the component sections).
    """
    if not isinstance(user, (dict, DictConfig)):
        return []
    types = _field_types(schema)
    names = list(types) + [p[len(prefix):] for p in allowed if p.startswith(prefix) and "." not in p[len(prefix):]]
    errors = []
    for key in user:
        key = str(key)
        path = f"{prefix}{key}"
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            fix = f"did you mean '{prefix}{hint[0]}'?" if hint else f"allowed keys: {', '.join(names)}"
            errors.append(f"unknown key '{path}': {fix}")
        elif key in types and dataclasses.is_dataclass(types[key]) and path not in allowed:
            errors.extend(_unknown_key_errors(user[key], types[key], path + ".", allowed))
    return errors


def _without(cfg: DictConfig, paths: tuple[str, ...]) -> DictConfig:
    """A copy of ``cfg`` without the given dotted paths."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg))
    for path in paths:
        parent, _, key = path.rpartition(".")
        node = OmegaConf.select(copy, parent) if parent else copy
        if isinstance(node, DictConfig) and key in node:
            node.pop(key)
    return copy


def _merge(schema: type, user: Any, prefix: str) -> tuple[Any, list[str]]:
    """Merge ``user`` onto the structured ``schema``; return the object and type/missing errors."""
    base = OmegaConf.structured(schema)
    user = OmegaConf.create(user if user is not None else {})
    # A '???' in the user's config would not override a default on merge, so look for it first.
    missing = sorted(OmegaConf.missing_keys(user))
    if missing:
        return None, [f"missing value for '{prefix}{k}': set it in the yaml or with {prefix}{k}=..." for k in missing]
    try:
        merged = OmegaConf.merge(base, user)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(exc).splitlines()[0]
        return None, [f"wrong type for '{prefix}{key}': {reason}"]
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        return None, [f"missing value for '{prefix}{k}': set it in the yaml or with {prefix}{k}=..." for k in missing]
    return OmegaConf.to_object(merged), []


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Read a yaml and apply ``key=value`` overrides, without validating."""
    cfg = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: the top level of a config must be a mapping of sections")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got: {', '.join(bad)}")
    for override in overrides:
        key, value = override.split("=", 1)
        try:
            parsed = OmegaConf.from_dotlist([f"value={value}"])._get_node("value")
            # A dict or list value replaces the node (`objective={name: nft}` drops grpo's keys);
            # a scalar sets one key.
            OmegaConf.update(cfg, key.strip(), parsed, merge=False, force_add=True)
        except (OmegaConfBaseException, ValueError, IndexError, KeyError) as exc:
            raise ConfigError(f"could not apply override {override!r}: {exc}") from exc
    return cfg


def _select(pm: PluginManager, kind: str, section: Any, path: str) -> tuple[Selected | None, list[str]]:
    if isinstance(section, str):
        section = {"name": section}
    if not isinstance(section, (dict, DictConfig)) or "name" not in section:
        return None, [f"'{path}' needs a 'name' naming a registered {kind} (see `gyremedia plugins`)"]
    body = OmegaConf.to_container(section) if isinstance(section, DictConfig) else dict(section)
    name = str(body.pop("name"))
    try:
        component = pm.component(kind, name)
    except PluginError as exc:
        return None, [f"'{path}.name': {exc}"]
    settings, errors, common_keys = None, [], []
    if kind in COMPONENT_SETTINGS:
        common_keys = [f.name for f in dataclasses.fields(COMPONENT_SETTINGS[kind])]
        settings, errors = _merge(COMPONENT_SETTINGS[kind], {k: body.pop(k) for k in common_keys if k in body}, f"{path}.")
    if component.options is None:
        errors += [f"unknown key '{path}.{k}': {kind} {name!r} takes no options besides {common_keys or 'its name'}"
                   for k in body]
        return (Selected(kind, name, None, settings, dict(component.meta)) if not errors else None), errors
    errors += _unknown_key_errors(body, component.options, f"{path}.", frozenset(f"{path}.{k}" for k in common_keys))
    if errors:
        return None, errors
    options, errors = _merge(component.options, body, f"{path}.")
    return (Selected(kind, name, options, settings, dict(component.meta)) if not errors else None), errors


def _section(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return node


def resolve_config(cfg: DictConfig, pm: PluginManager) -> ResolvedConfig:
    """Validate a loaded config against the core schema and every selected plugin's options.

    Raises :class:`ConfigError` listing every problem found, each naming its key and fix.
    """
    component_paths = frozenset(COMPONENT_SECTIONS)
    errors = _unknown_key_errors(cfg, TrainConfig, "", component_paths)
    core = None
    if not errors:
        # logging.loggers is a field of the core schema (a list of anything); the others are not.
        core_paths = tuple(p for p in COMPONENT_SECTIONS if p != "logging.loggers")
        core, errors = _merge(TrainConfig, _without(cfg, core_paths), "")

    selected: dict[str, Any] = {}
    for path, (kind, is_list) in COMPONENT_SECTIONS.items():
        section = _section(cfg, path)
        if section is None or (isinstance(section, (list, ListConfig)) and not section and path == "rewards"):
            if path in OPTIONAL_SECTIONS:
                selected[path] = OPTIONAL_SECTIONS[path]
                continue
            what = "a list of" if is_list else "a"
            errors.append(f"missing value for '{path}': the config must select {what} {kind} (see `gyremedia plugins`)")
            continue
        if is_list:
            if not isinstance(section, (list, ListConfig)):
                errors.append(f"'{path}' must be a list of {kind}s")
                continue
            items = []
            for i, item in enumerate(section):
                sel, errs = _select(pm, kind, item, f"{path}.{i}")
                errors += errs
                items.append(sel)
            selected[path] = items
        else:
            sel, errs = _select(pm, kind, section, path)
            errors += errs
            selected[path] = sel

    errors += _default_weighting(pm, selected, given=_section(cfg, "weighting") is not None)
    if core is not None:
        errors += _cross_checks(core, selected, pm)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return ResolvedConfig(
        core=core,
        backbone=selected["backbone"],
        sampler=selected["sampler"],
        objective=selected["objective"],
        rewards=selected["rewards"],
        regularizers=selected["regularizers"],
        loggers=selected["logging.loggers"],
        eval_sampler=selected["eval.sampler"],
        weighting=selected["weighting"],
        gold_rewards=selected["monitor.gold"],
    )


def _pareto_checks(core: TrainConfig, rewards: list[Selected], backbone: Selected | None) -> list[str]:
    """A Pareto run needs several rewards and a backbone that takes one preference input per reward."""
    pareto = core.pareto
    if not pareto.enabled:
        return []
    errors = []
    if len(rewards) < 2:
        errors.append("pareto.enabled needs at least 2 rewards to weigh against each other")
    if pareto.concentration <= 0 or pareto.sweep < 2:
        errors.append("pareto.concentration must be > 0 and pareto.sweep >= 2")
    if backbone is not None:
        inputs = getattr(backbone.options, "preference_inputs", None)
        if inputs is None:
            errors.append(f"pareto.enabled: backbone {backbone.name!r} cannot be conditioned on preference weights")
        elif inputs != len(rewards):
            errors.append(f"pareto.enabled with {len(rewards)} rewards: set backbone.preference_inputs={len(rewards)} "
                          f"(it is {inputs})")
    return errors


def _default_weighting(pm: PluginManager, selected: dict[str, Any], given: bool) -> list[str]:
    """Select the objective's default timestep weighting when the yaml names none; refuse a
    ``weighting`` section for an objective that weights no timesteps."""
    objective = selected.get("objective")
    if objective is None:
        return []
    default = objective.meta.get("default_weighting")
    if default is None:
        if given:
            users = sorted(c.name for c in pm.registry.all() if c.kind == "objective" and c.meta.get("default_weighting"))
            return [f"'weighting': objective {objective.name!r} has no timestep weighting; remove the section, or "
                    f"use an objective that has one ({', '.join(users)})"]
        return []
    if given:
        return []
    selected["weighting"], errors = _select(pm, "weighting", default, "weighting")
    return errors


def _cross_checks(core: TrainConfig, selected: dict[str, Any], pm: PluginManager) -> list[str]:
    """Constraints between keys that no single field's type can express."""
    errors = []
    r = core.rollout
    if r.group_size < 2:
        errors.append(f"rollout.group_size={r.group_size}: a group needs at least 2 samples to compare; set rollout.group_size>=2")
    elif r.batch_size % r.group_size:
        lower = r.batch_size - r.batch_size % r.group_size
        errors.append(
            f"rollout.batch_size={r.batch_size} is not divisible by rollout.group_size={r.group_size}: "
            f"use rollout.batch_size={lower or r.group_size} or {lower + r.group_size}"
        )
    if r.num_steps < 1:
        errors.append(f"rollout.num_steps={r.num_steps}: set rollout.num_steps>=1")
    if r.branch_steps:
        leaves = r.branch_width ** len(r.branch_steps)
        if sorted(set(r.branch_steps)) != list(r.branch_steps) or not all(0 <= b < r.num_steps for b in r.branch_steps):
            errors.append(f"rollout.branch_steps={list(r.branch_steps)}: use increasing step indices in [0, {r.num_steps})")
        elif r.branch_width < 2:
            errors.append("rollout.branch_width must be >= 2")
        elif r.group_size != leaves:
            errors.append(f"rollout.group_size={r.group_size}: a tree with {len(r.branch_steps)} branch steps of width "
                          f"{r.branch_width} has {leaves} leaves: set rollout.group_size={leaves}")
        sampler = selected.get("sampler")
        if sampler is not None and not sampler.meta.get("has_log_prob"):
            errors.append(f"rollout.branch_steps needs a stochastic sampler to branch; {sampler.name!r} is deterministic")
    if core.advantage.std not in ("group", "global", "none"):
        errors.append(f"advantage.std={core.advantage.std!r}: allowed values are group, global, none")
    if core.advantage.combine not in ("sum", "normalize_each"):
        errors.append(f"advantage.combine={core.advantage.combine!r}: allowed values are sum, normalize_each")
    rewards = [s for s in selected.get("rewards") or [] if s is not None]
    for i, reward in enumerate(rewards):
        if reward.settings.on_failure not in ("fail", "drop"):
            errors.append(f"rewards.{i}.on_failure={reward.settings.on_failure!r}: allowed values are fail, drop")
        if reward.settings.timeout < 0:
            errors.append(f"rewards.{i}.timeout={reward.settings.timeout}: use seconds > 0, or 0 for no limit")
    gold = [s.name for s in selected.get("monitor.gold") or [] if s is not None]
    for name in sorted({n for n in gold if gold.count(n) > 1}):
        errors.append(f"monitor.gold selects reward {name!r} twice: their scores would share eval/gold/{name}")
    names = [reward.name for reward in rewards]
    for name in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"reward {name!r} is selected twice: combine its scores in one reward, or register it "
                      "under a second name")
    if core.train.num_minibatches < 1:
        errors.append("train.num_minibatches must be >= 1")
    if not core.data.prompts and not core.data.prompts_file:
        errors.append("no prompts: set data.prompts (a list) or data.prompts_file")
    for key, path in (("data.prompts_file", core.data.prompts_file), ("eval.prompts_file", core.eval.prompts_file)):
        if path and not Path(path).is_file():
            errors.append(f"{key}={path!r} does not exist")
    if core.eval.metric is not None and "/" not in core.eval.metric:
        errors.append(f"eval.metric={core.eval.metric!r}: expected '<reward>/<component>', e.g. 'shapes_verifier/correct'")
    backbone = selected.get("backbone")
    for path in ("sampler", "eval.sampler"):
        chosen = selected.get(path)
        if backbone is None or chosen is None:
            continue
        predicts, steps_on = backbone.meta.get("prediction"), chosen.meta.get("prediction")
        if predicts and steps_on and predicts != steps_on:
            fits = sorted(c.name for c in pm.registry.all() if c.kind == "sampler" and c.meta.get("prediction") == predicts)
            errors.append(f"{path} {chosen.name!r} steps on {steps_on} predictions, but backbone {backbone.name!r} predicts "
                          f"{predicts}: choose one of {', '.join(fits)}")
    media = backbone.meta.get("media_kind") if backbone is not None else None
    for path, chosen in [*((f"rewards.{i}", r) for i, r in enumerate(rewards)),
                         *((f"monitor.gold.{i}", g) for i, g in enumerate(selected.get("monitor.gold") or []))]:
        kinds = chosen.meta.get("kinds") if chosen is not None else None
        if media and kinds and media not in kinds:
            fits = sorted(c.name for c in pm.registry.all() if c.kind == "reward" and media in c.meta.get("kinds", ()))
            errors.append(f"{path}: reward {chosen.name!r} scores {'/'.join(sorted(kinds))}, but backbone "
                          f"{backbone.name!r} makes {media}: choose one of {', '.join(fits) or '(none registered)'}")
    errors += _pareto_checks(core, rewards, backbone)
    objective, sampler = selected.get("objective"), selected.get("sampler")
    for i, regularizer in enumerate(selected.get("regularizers") or []):
        if regularizer is not None and objective is not None and regularizer.meta.get("requires_log_prob") \
                and not objective.meta.get("requires_log_prob"):
            errors.append(f"regularizers.{i}: {regularizer.name!r} compares replayed sampler transitions, which "
                          f"objective {objective.name!r} does not make: use a ratio objective (grpo, tree_grpo) or "
                          "a velocity regularizer (velocity_kl)")
    if objective is not None and sampler is not None:
        if objective.meta.get("requires_log_prob") and not sampler.meta.get("has_log_prob"):
            errors.append(
                f"objective {objective.name!r} needs per-transition log-probs, but sampler {sampler.name!r} is "
                "deterministic: choose a stochastic sampler (e.g. sampler.name=flow_sde) or an objective "
                "that needs none"
            )
    return errors


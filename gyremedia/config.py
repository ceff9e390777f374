"""Config is the interface: one yaml plus ``key=value`` overrides, validated before any model loads.

The core sections are omegaconf structured dataclasses. The component sections (``backbone``,
``sampler``, ``objective``, ``rewards``, ``regularizers``, ``logging.loggers``) hold a ``name`` and
that component's options, validated against the options dataclass its plugin registered.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gyremedia.options import OptionError, field_hint, nested_schema, option, prompts_file, validate
from gyremedia.registry import ALLOW_LIST_ENV, PluginError, PluginHost


def asset_path(relative: str) -> str:
    """Absolute path of a file shipped in the repository's ``assets/`` folder (``gyremedia.assets``)."""
    from importlib import resources

    return str(resources.files("gyremedia.assets") / relative)


if not OmegaConf.has_resolver("asset"):
    # `${asset:shapes16/model}` in a yaml points into assets/, wherever gyremedia is installed.
    OmegaConf.register_resolver("asset", asset_path)


class ConfigError(ValueError):
    """The config is invalid; the message names each offending key and how to fix it."""

    exit_code = 2


@dataclass
class RunSection:
    output_dir: str = option("runs/default", help="the run folder: config, metrics, samples, checkpoints, export")
    seed: int = option(0, ge=0, help="seeds every random stream of the run")


@dataclass
class DataSection:
    prompts: list[str] = option(
        default_factory=list,
        help="training prompts",
        hint="data.prompts is a list of prompts, e.g. data.prompts=[a cat, a dog]; for a file use data.prompts_file",
    )
    prompts_file: str | None = option(
        None,
        check=prompts_file,
        help="one prompt per line, or records (.jsonl, .json, "
        ".csv, .parquet: the text under data.prompt_column, the rest its fields); "
        "added to data.prompts",
    )
    dataset: str | None = option(
        None,
        help="a Hugging Face dataset of records (a save_to_disk folder, a folder of "
        "data files or a hub id; pip install 'gyremedia[data]'); added to data.prompts",
    )
    split: str = option("train", help="the split of data.dataset")
    prompt_column: str = option("prompt", help="the field of a record that holds the prompt's text")
    eval_prompts: list[str] = option(
        default_factory=list,
        help="held-out prompts (default: the training prompts)",
        hint="data.eval_prompts is a list of prompts; for a file use eval.prompts_file",
    )
    offline: str | None = option(
        None,
        help="train on the scored rollouts `gyremedia rollout CONFIG --out DIR` saved in this folder (step k: "
        "saved step k mod their number) instead of sampling",
        owner="offline",
    )


@dataclass
class RolloutSection:
    batch_size: int = option(8, ge=1, help="samples per step over all processes")
    group_size: int = option(4, ge=2, help="samples per prompt; advantages are normalised within a group")
    num_steps: int = option(10, ge=1, help="transitions per sample (denoising steps)")
    guidance_scale: float = option(1.0, ge=1, help="classifier-free guidance; 1 = none")
    same_noise_in_group: bool = option(False, help="every member of a group starts from the same noise")
    # Score rollout k in worker threads while rollout k+1 is sampled. Each rollout is then trained
    # one optimizer step after the policy that sampled it (the ratio objectives' clip covers that).
    async_scoring: bool = option(False, help="score a rollout while the next one is sampled")
    # Tree rollouts (TreeGRPO): a group's samples share `branch_roots` trajectories and split into
    # `branch_width` children at each of these step indices; group_size must be
    # branch_roots * branch_width ** len(branch_steps).
    branch_steps: list[int] = option(default_factory=list, ge=0, help="tree rollouts: step indices where nodes split")
    branch_width: int = option(2, ge=2, help="tree rollouts: children per split")
    branch_roots: int = option(
        1, ge=1, help="tree rollouts: trees per group, each from its own initial noise (more diverse leaves)"
    )
    # Sol-RL's two-stage rollouts: per prompt, `candidates` cheap samples (`candidate_steps` steps of the
    # eval sampler) are scored by the run's rewards; the group_size / 2 best and worst of their initial
    # noises are then sampled at full quality with the run's sampler, and only those are trained on.
    candidates: int = option(
        0,
        ge=0,
        help="candidate initial noises drawn per prompt and scored cheaply "
        "(a multiple of group_size); 0 = one-stage rollouts",
        owner="candidates",
    )
    candidate_steps: int = option(
        3, ge=1, help="denoising steps of each candidate (the eval sampler's)", owner="candidates"
    )

    def validate(self) -> None:
        """The batch holds whole groups; a tree branches at steps it has, and its leaves are its group."""
        if self.batch_size % self.group_size:
            lower = self.batch_size - self.batch_size % self.group_size
            raise OptionError(
                "batch_size",
                f"not divisible by rollout.group_size={self.group_size}: use rollout.batch_size="
                f"{lower or self.group_size} or {lower + self.group_size}",
            )
        if not self.branch_steps:
            return
        steps, leaves = list(self.branch_steps), self.branch_roots * self.branch_width ** len(self.branch_steps)
        if sorted(set(steps)) != steps or not all(b < self.num_steps for b in steps):
            raise OptionError("branch_steps", f"use increasing step indices in [0, {self.num_steps})")
        if self.group_size != leaves:
            raise OptionError(
                "group_size",
                f"{self.branch_roots} tree(s) with {len(steps)} branch steps of width {self.branch_width} have "
                f"{leaves} leaves: set rollout.group_size={leaves}",
            )


@dataclass
class TrainSection:
    steps: int = option(100, ge=1, help="optimizer steps, one rollout each")
    learning_rate: float = option(1e-4, gt=0, help="AdamW learning rate")
    weight_decay: float = option(1e-4, ge=0, help="AdamW weight decay")
    adam_beta1: float = option(0.9, ge=0, lt=1, help="AdamW beta1")
    adam_beta2: float = option(0.999, ge=0, lt=1, help="AdamW beta2")
    # PyTorch's fused AdamW kernel (one kernel over all parameters; its speed-up is in docs/benchmarks.md) where
    # every parameter's device has it. Off by default: its updates differ from the loop's by float rounding, so a
    # run is another draw of the figures recorded with the loop.
    fused_adamw: bool = option(False, help="use the fused AdamW kernel where the device has it")
    # The first minibatch trains on the weights that sampled it: the rollout's forwards of the transitions it will
    # replay are computed with gradients and kept, and training takes them instead of running the model again
    # (one forward fewer per trained transition of that minibatch; the same updates up to float rounding). Costs
    # their activations' memory from sampling to training (no saving under gradient checkpointing). Off by
    # default, so a run stays the same draw as the figures recorded without it. Under DDP that minibatch averages
    # its gradients itself; a sharded (FSDP2) model replays.
    reuse_rollout_forward: bool = option(
        False, help="train the first minibatch on the rollout's own forwards (grpo; not sharded)", owner="forward_reuse"
    )
    # torch.compile of the policy's network and its frozen reference copy, in place (nn.Module.compile: the same
    # parameter names, so checkpoints and exports do not change). The first rollout, update and evaluation compile
    # (about a minute on a CPU), later steps run the compiled kernels. They round differently from eager ones, so
    # a run is another draw of the figures recorded without it. A sharded (FSDP2) model is compiled after sharding:
    # its blocks' all-gathers run around the compiled graphs.
    compile: bool = option(False, help="compile the policy's network with torch.compile")
    max_grad_norm: float = option(1.0, gt=0, help="gradients are clipped to this global norm")
    warmup_steps: int = option(0, ge=0, help="linear learning-rate warm-up steps")
    num_minibatches: int = option(1, ge=1, help="optimizer steps per pass over a rollout; each takes a slice of it")
    num_iterations: int = option(
        1, ge=1, help="passes over each rollout (PPO epochs); ratio objectives compare with the policy that sampled it"
    )
    # A step whose loss or gradient is NaN or inf: "stop" ends the run there naming the loss terms that were
    # not finite (the weights and checkpoints stay finite); "skip" drops that update and counts it
    # (metric train/nonfinite_skipped).
    on_nonfinite: Literal["stop", "skip"] = option("stop", help="what a NaN/inf loss or gradient does")
    # FSDP2 (torch fully_shard per transformer block; gyremedia/runtime/sharding.py): each process holds a shard of
    # the weights, gradients and optimizer state. "auto" shards when launched with accelerate's FSDP config.
    sharding: Literal["auto", "none", "fsdp2"] = option("auto", help="shard the trained model over the processes")
    # bf16 autocast for every forward with fp32 master weights (LoRA: bf16 frozen base weights, fp32 adapters);
    # log-probs, losses and advantages stay fp32. fp16 would need loss scaling, which is not built.
    mixed_precision: Literal["none", "bf16"] = option("none", help="compute in bf16 under autocast")


@dataclass
class AdvantageSection:
    std: Literal["group", "global", "none"] = option("group", help="what the centred reward is divided by")
    eps: float = option(1e-4, gt=0, help="added to the std before dividing")
    # How several rewards become one advantage: "sum" normalises the weighted sum of the rewards;
    # "normalize_each" normalises each reward within its groups, then sums the weighted advantages
    # (a reward with a large scale cannot drown the others).
    combine: Literal["sum", "normalize_each"] = option("sum", help="how several rewards become one advantage")
    # Per-frame credit for video policies: each frame's own scores (rewards that report them) give it its own
    # group-relative advantage, and the objective weights that frame's part of its loss by it.
    per_frame: bool = option(
        False, help="an advantage per video frame, from the rewards' per-frame scores", owner="frame_credit"
    )
    # DDPO's per-prompt stat tracker: a prompt's statistics come from its last `history` rewards over
    # all steps (this step's group included), the whole batch's until it has `min_count` of them.
    history: int = option(
        0,
        ge=0,
        help="rewards kept per prompt across steps for its mean and std (DDPO's "
        "buffer_size 16); 0 = this step's group only",
        owner="prompt_history",
    )
    min_count: int = option(
        16,
        ge=1,
        help="with history: fewer rewards of a prompt use the batch's statistics (DDPO's min_count)",
        owner="prompt_history",
    )


@dataclass
class ParetoSection:
    """ParetoSlider: one model conditioned on reward-preference weights instead of a fixed weighted sum."""

    enabled: bool = option(
        False, help="needs >= 2 rewards and a backbone with preference_inputs = their number", owner="pareto"
    )
    concentration: float = option(
        1.0, gt=0, help="Dirichlet alpha of the weights drawn per prompt group (1: uniform)", owner="pareto"
    )
    sweep: int = option(5, ge=2, help="weight settings evaluated after training (the front)", owner="pareto")


@dataclass
class MonitorSection:
    """Reward-hacking monitor (plugins/gyremedia_features/monitor.py); ``monitor.gold`` lists held-out rewards like ``rewards``."""

    tolerance: float = option(
        0.005, ge=0, help="changes of eval means smaller than this count as flat", owner="monitor"
    )
    min_diversity: float = option(
        0.5, ge=0, le=1, help="warn below this share of the first eval's in-group diversity", owner="monitor"
    )
    drift: bool = option(False, help="measure the velocity drift from the reference at each eval", owner="monitor")
    drift_levels: int = option(3, ge=1, help="noise levels the drift is measured at", owner="monitor")


@dataclass
class CheckpointSection:
    every: int = option(10, ge=1, help="steps between checkpoints (the last step is always saved)")
    keep_last: int = option(2, ge=1, help="checkpoints kept on disk, newest first")
    # Also save when this many seconds passed since the last checkpoint (a preemptible cluster's bound
    # on lost work); 0 = only every `every` steps.
    max_lost_seconds: float = option(0.0, ge=0, help="save when this long has passed since the last checkpoint")


@dataclass
class EvalSection:
    every: int = option(0, ge=0, help="steps between evaluations; 0 evaluates only before and after training")
    prompts_file: str | None = option(
        None,
        check=prompts_file,
        help="held-out prompts or records, read as data.prompts_file is (default: "
        "data.eval_prompts, else the train prompts)",
    )
    dataset: str | None = option(None, help="held-out records from a Hugging Face dataset, as data.dataset")
    split: str = option("test", help="the split of eval.dataset")
    samples: int = option(256, ge=2, help="samples per evaluation, prompts cycled; the same seeds every time")
    seed: int = option(1234, ge=0, help="seed of the evaluation's noise")
    num_steps: int | None = option(None, ge=1, help="transitions per sample (default: rollout.num_steps)")
    metric: str | None = option(
        None, help="'<reward>/<component>' reported as accuracy (default: the first reward's score)"
    )
    grid_size: int = option(16, ge=1, help="samples shown in the before/after grids")


@dataclass
class ExportSection:
    on_train_end: bool = option(True, help="write RUN_DIR/pipeline, a folder the backbone library's stock loader reads")
    merge_lora: bool = option(True, help="merge LoRA adapters into the weights (else save the adapters alone)")


@dataclass
class LoggingSection:
    loggers: list[Any] = option(default_factory=list, help="names, or {name: ..., option: ...}")
    progress: bool = option(True, help="show progress bars")


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
OPTIONAL_SECTIONS: dict[str, Any] = {
    "sampler": None,
    "regularizers": [],
    "logging.loggers": [],
    "eval.sampler": None,
    "weighting": None,
    "monitor.gold": [],
}


@dataclass
class RewardSettings:
    """Keys every reward accepts besides its own options."""

    weight: float = option(1.0, help="the reward's weight in the total (negative: minimise it)")
    label: str | None = option(
        None,
        check=lambda v: None if v and "/" not in v else "give a name without '/'",
        help="the name the run gives it (metrics reward/<label>/..., eval.metric): default its "
        "registered name, or what it serves (remote); select a reward twice with two labels",
    )
    # What a failing sample does: "fail" stops the run naming the reward, step and prompt; "drop"
    # removes the sample from its group (advantage 0, excluded from the group's statistics) and
    # counts it in the metric reward/<name>/dropped. A failure is an exception or a timeout (the
    # whole call's samples) or a NaN/inf score (that sample).
    on_failure: Literal["fail", "drop"] = option("fail", help="what a failing sample does")
    timeout: float = option(0.0, ge=0, help="seconds one call may take before it counts as failed; 0 waits forever")
    max_dropped: float = option(
        0.5,
        ge=0,
        le=1,
        help="with on_failure=drop: the share of samples it may drop over "
        "the last 10 steps before the run stops (a server that is down drops them all)",
    )


@dataclass
class RegularizerSettings:
    """Keys every regularizer accepts besides its own options."""

    weight: float = option(1.0, ge=0, help="the term's weight in the loss")


#: Settings dataclass of the keys a list component accepts besides its own options.
COMPONENT_SETTINGS: dict[str, type] = {"reward": RewardSettings, "regularizer": RegularizerSettings}


@dataclass
class Selected:
    """A component chosen by the config, with its validated options."""

    kind: str
    name: str
    options: Any  # instance of the plugin's options dataclass, or None
    settings: Any = None  # instance of COMPONENT_SETTINGS[kind] (weight, failure policy, ...), or None
    meta: dict[str, Any] = field(default_factory=dict)  # the component's capabilities and description
    implied_by: str | None = None  # the key that selected it, when no section names it (objective.kl_beta)
    registered: str | None = None  # the name it is registered under, when the run calls it otherwise (a label)

    @property
    def component(self) -> str:
        """The registered name, which builds it."""
        return self.registered or self.name

    @property
    def weight(self) -> float:
        return self.settings.weight if self.settings is not None else 1.0

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.component}
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
    sampler: Selected | None  # None for a token policy, which samples itself
    objective: Selected
    rewards: list[Selected]
    regularizers: list[Selected]
    loggers: list[Selected]
    eval_sampler: Selected | None = None
    weighting: Selected | None = None  # timestep weighting of an ELBO-family objective
    gold_rewards: list[Selected] = field(default_factory=list)  # monitor.gold: scored at evals, never trained on

    def to_yaml(self) -> str:
        """The fully resolved config (every default filled in), as written into the run folder."""
        data = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(self.core), resolve=True))
        for attr in ("backbone", "sampler", "objective"):
            if getattr(self, attr) is not None:
                data[attr] = getattr(self, attr).as_dict()
        data["rewards"] = [s.as_dict() for s in self.rewards]
        data["regularizers"] = [s.as_dict() for s in self.regularizers if s.implied_by is None]
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
    names = list(types) + [p[len(prefix) :] for p in allowed if p.startswith(prefix) and "." not in p[len(prefix) :]]
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
    copy = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg)))
    for path in paths:
        parent, _, key = path.rpartition(".")
        node = OmegaConf.select(copy, parent) if parent else copy
        if isinstance(node, DictConfig) and key in node:
            node.pop(key)
    return copy


def _merge(schema: type, user: Any, prefix: str) -> tuple[Any, list[str]]:
    """Merge ``user`` onto the structured ``schema`` and validate the values (:func:`gyremedia.options.validate`);
    return the options object and the type, missing-value and range errors."""
    base = OmegaConf.structured(schema)
    user = OmegaConf.create(user if user is not None else {})
    # A '???' in the user's config would not override a default on merge, so look for it first.
    missing = sorted(OmegaConf.missing_keys(user))
    if missing:
        return None, [f"missing value for '{prefix}{k}': set it in the yaml or with {prefix}{k}=..." for k in missing]
    try:
        merged = OmegaConf.merge(base, user)
    except OmegaConfBaseException as exc:
        return None, [_type_error(schema, user, prefix, exc)]
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        return None, [f"missing value for '{prefix}{k}': set it in the yaml or with {prefix}{k}=..." for k in missing]
    options = OmegaConf.to_object(merged)
    return options, validate(options, prefix)


def _type_error(schema: type, user: DictConfig, prefix: str, exc: OmegaConfBaseException) -> str:
    """One line for a value omegaconf refused: the key, the value, the expected type or choices, a hint."""
    key = str(getattr(exc, "full_key", None) or "?")
    value = OmegaConf.select(user, key, default=None, throw_on_missing=False) if key != "?" else None
    shown = f"={OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value!r}"
    declared = nested_schema(schema, key) if key != "?" else None
    expected = hint = None
    if declared is not None:
        owner, name = declared
        annotation = typing.get_type_hints(owner).get(name)
        expected = _describe_type(annotation) if annotation is not None else None
        hint = field_hint(owner, name)
    reason = f"expected {expected}" if expected else str(exc).splitlines()[0]
    return f"{prefix}{key}{shown}: {reason}" + (f"; {hint}" if hint else "")


def _describe_type(annotation: Any) -> str:
    """``a number``, ``one of group, global, none``, ``a list of strings``, ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        named = [_describe_type(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" (or null)" if type(None) in args else "")
    if origin in (list, tuple):
        inner = _describe_type(args[0]) if args else "values"
        return f"a list of {inner.removeprefix('a ').removeprefix('an ')}s" if inner not in ("anything",) else "a list"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", Any: "anything"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


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
        key = key.strip()
        try:
            parsed = OmegaConf.from_dotlist([f"value={value}"])._get_node("value")
            previous = _component_name(cfg, key)
            # A dict or list value replaces the node (`objective={name: nft}` drops grpo's keys);
            # a scalar sets one key.
            OmegaConf.update(cfg, key, parsed, merge=False, force_add=True)
            if previous is not None and previous != _component_name(cfg, key):
                # `objective.name=grpo` keeps the old objective's options: remember whose they were.
                OmegaConf.update(cfg, key.rpartition(".")[0] + "." + REPLACED_NAME, previous, force_add=True)
        except (OmegaConfBaseException, ValueError, IndexError, KeyError) as exc:
            raise ConfigError(f"could not apply override {override!r}: {exc}") from exc
    return cfg


#: Set by :func:`load_config` in a component section whose ``name`` an override changed: the old name.
REPLACED_NAME = "_replaced_name"


def _component_name(cfg: DictConfig, key: str) -> str | None:
    """The current ``name`` of the section ``key`` names the name of (``objective.name``, ``rewards.0.name``),
    if that section holds options besides its name."""
    parent, _, leaf = key.rpartition(".")
    if leaf != "name" or not parent:
        return None
    section = OmegaConf.select(cfg, parent, default=None, throw_on_missing=False)
    if not isinstance(section, DictConfig) or len([k for k in section if k not in ("name", REPLACED_NAME)]) == 0:
        return None
    name = section.get("name")
    return str(name) if name is not None else None


def _select(pm: PluginHost, kind: str, section: Any, path: str) -> tuple[Selected | None, list[str]]:
    if isinstance(section, str):
        section = {"name": section}
    if not isinstance(section, (dict, DictConfig)) or "name" not in section:
        return None, [f"'{path}' needs a 'name' naming a registered {kind} (see `gyremedia plugins`)"]
    body = cast(dict[str, Any], OmegaConf.to_container(section)) if isinstance(section, DictConfig) else dict(section)
    name = str(body.pop("name"))
    replaced = body.pop(REPLACED_NAME, None)
    try:
        component = pm.component(kind, name)
    except PluginError as exc:
        return None, [f"'{path}.name': {exc}"]
    settings, errors, common_keys = None, cast(list[str], []), cast(list[str], [])
    if kind in COMPONENT_SETTINGS:
        common_keys = [f.name for f in dataclasses.fields(COMPONENT_SETTINGS[kind])]
        settings, errors = _merge(
            COMPONENT_SETTINGS[kind], {k: body.pop(k) for k in common_keys if k in body}, f"{path}."
        )
    known = {f.name for f in dataclasses.fields(component.options)} if component.options is not None else set()
    leftover = sorted(k for k in body if k not in known)
    if replaced is not None and leftover:
        return None, errors + [
            f"{path}.name={name} replaced {kind} {replaced!r}, whose options {', '.join(leftover)} are still set and are not "
            f'options of {name!r}: replace the whole section instead, e.g. "{path}={{name: {name}}}"'
        ]
    if component.options is None:
        errors += [
            f"unknown key '{path}.{k}': {kind} {name!r} takes no options besides {common_keys or 'its name'}"
            for k in body
        ]
        label = getattr(settings, "label", None)
        return (
            Selected(kind, label or name, None, settings, dict(component.meta), registered=name if label else None)
            if not errors
            else None
        ), errors
    errors += _unknown_key_errors(body, component.options, f"{path}.", frozenset(f"{path}.{k}" for k in common_keys))
    if errors:
        return None, errors
    options, errors = _merge(component.options, body, f"{path}.")
    if errors:
        return None, errors
    # An options class may add to its component's capabilities for this selection: a remote reward's media kinds,
    # and the name it serves under ("label"), which the run calls it by unless the yaml sets a label.
    meta = {**component.meta, **(options.capabilities() if hasattr(options, "capabilities") else {})}
    served_as = meta.pop("label", None)
    label = getattr(settings, "label", None) or served_as  # rewards have labels; regularizers do not
    return Selected(kind, label or name, options, settings, meta, registered=name if label else None), []


def select_component(pm: PluginHost, kind: str, section: dict[str, Any], path: str) -> Selected:
    """One component chosen outside a run config (``gyremedia serve-reward NAME key=value``), checked as in a run:
    raises :class:`ConfigError` with one line per problem."""
    selected, errors = _select(pm, kind, section, path)
    if errors or selected is None:
        raise ConfigError("; ".join(errors))
    return selected


def _section(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return node


def resolve_config(cfg: DictConfig, pm: PluginHost) -> ResolvedConfig:
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

    if core is not None:
        errors += _unowned_keys(core, pm)
    errors += _default_weighting(pm, selected, given=_section(cfg, "weighting") is not None)
    errors += _kl_shortcut(pm, selected)
    if core is not None:
        errors += _cross_checks(core, selected, pm, sampler_given=_section(cfg, "sampler") is not None)
    if errors or core is None:
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{len(errors)} problems in the config:\n  - " + "\n  - ".join(errors)
        )
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


def _unowned_keys(core: TrainConfig, pm: PluginHost) -> list[str]:
    """Keys a feature plugin reads (``option(owner=...)``), set away from their defaults while it is not loaded."""
    errors = []
    for section in dataclasses.fields(core):
        values = getattr(core, section.name)
        for declared in dataclasses.fields(values):
            owner = declared.metadata.get("owner")
            default = (
                declared.default
                if declared.default is not dataclasses.MISSING
                else cast(Callable[[], Any], declared.default_factory)()
            )
            if owner and not pm.pm.has_plugin(owner) and getattr(values, declared.name) != default:
                errors.append(
                    f"{section.name}.{declared.name} is read by the plugin {owner!r}, which is not loaded: "
                    f"add {owner} to {ALLOW_LIST_ENV} (or install it), or leave {section.name}.{declared.name} "
                    "at its default"
                )
    return errors


def _default_weighting(pm: PluginHost, selected: dict[str, Any], given: bool) -> list[str]:
    """Select the objective's default timestep weighting when the yaml names none; refuse a
    ``weighting`` section for an objective that weights no timesteps."""
    objective = selected.get("objective")
    if objective is None:
        return []
    default = objective.meta.get("default_weighting")
    if default is None:
        if given:
            users = sorted(
                c.name for c in pm.registry.all() if c.kind == "objective" and c.meta.get("default_weighting")
            )
            return [
                f"'weighting': objective {objective.name!r} has no timestep weighting; remove the section, or "
                f"use an objective that has one ({', '.join(users)})"
            ]
        return []
    if given:
        return []
    selected["weighting"], errors = _select(pm, "weighting", default, "weighting")
    return errors


def _kl_shortcut(pm: PluginHost, selected: dict[str, Any]) -> list[str]:
    """An objective's ``kl_beta > 0`` selects its ``kl_regularizer`` with that weight: the KL to the
    reference is computed by one piece of code however it is asked for."""
    objective, regularizers = selected.get("objective"), selected.get("regularizers")
    name = objective.meta.get("kl_regularizer") if objective is not None else None
    beta = getattr(objective.options, "kl_beta", 0.0) if objective is not None else 0.0
    if not name or not beta or regularizers is None:
        return []
    if any(r is not None and r.name == name for r in regularizers):
        return [
            f"objective.kl_beta={beta} selects the {name!r} regularizer, which regularizers lists too: keep one "
            f"(objective.kl_beta=0, or remove {name!r} from regularizers)"
        ]
    component = pm.component("regularizer", name)
    options = OmegaConf.to_object(OmegaConf.structured(component.options)) if component.options is not None else None
    selected["regularizers"] = [
        *regularizers,
        Selected(
            "regularizer",
            name,
            options,
            RegularizerSettings(weight=beta),
            dict(component.meta),
            implied_by="objective.kl_beta",
        ),
    ]
    return []


def _cross_checks(core: TrainConfig, selected: dict[str, Any], pm: PluginHost, sampler_given: bool) -> list[str]:
    """Constraints between keys that no single field's range can express (each field's own range is
    checked where it is declared, :mod:`gyremedia.options`); the features check their own keys
    (``gyremedia_check_config``)."""
    errors = _transition_checks(selected, pm, sampler_given) + _rollout_checks(core, selected, pm)
    backbone = selected.get("backbone")
    if core.train.compile and backbone is not None and not backbone.meta.get("compilable"):
        errors.append(
            f"train.compile: backbone {backbone.name!r} does not compile its networks (it declares no "
            "compilable = True): set train.compile=false"
        )
    errors += _reward_checks(core, selected) + _prompt_checks(core) + _fit_checks(selected, pm)
    errors += _objective_checks(core, selected, pm)
    if selected.get("monitor.gold") and not pm.pm.has_plugin("monitor"):
        errors.append(
            f"monitor.gold is scored by the plugin 'monitor', which is not loaded: add monitor to "
            f"{ALLOW_LIST_ENV} (or install it), or remove monitor.gold"
        )
    for found in pm.hook.gyremedia_check_config(core=core, selected=selected):
        errors += found or []
    return errors


def _rollout_checks(core: TrainConfig, selected: dict[str, Any], pm: PluginHost) -> list[str]:
    """A tree branches with a stochastic sampler (the rollout section checks its own shape)."""
    sampler = selected.get("sampler")
    if core.rollout.branch_steps and sampler is not None and not sampler.meta.get("has_log_prob"):
        return [
            f"rollout.branch_steps needs a stochastic sampler to branch; {sampler.name!r} is deterministic: "
            f"choose one of {', '.join(_names(pm, 'sampler', has_log_prob=True))}"
        ]
    return []


def _reward_checks(core: TrainConfig, selected: dict[str, Any]) -> list[str]:
    """Each reward selected once; ``eval.metric`` names one of them."""
    errors, rewards = [], [s for s in selected.get("rewards") or [] if s is not None]
    names = [reward.name for reward in rewards]
    for name in sorted({n for n in names if names.count(n) > 1}):
        errors.append(
            f"reward {name!r} is selected twice: combine its scores in one reward, or give each selection "
            "its own label (rewards.N.label)"
        )
    every_reward_resolved = None not in (selected.get("rewards") or [])  # else its own error says why
    if (
        core.eval.metric is not None
        and "/" not in core.eval.metric
        and core.eval.metric not in names
        and every_reward_resolved
    ):
        example = f"{rewards[0].name}/<component>" if rewards else "<reward>/<component>"
        errors.append(
            f"eval.metric={core.eval.metric!r}: expected a reward's name (its score) or "
            f"'<reward>/<component>', e.g. {example!r}"
        )
    return errors


def _fit_checks(selected: dict[str, Any], pm: PluginHost) -> list[str]:
    """The samplers step on what the backbone predicts; the rewards score the media it makes."""
    errors: list[str] = []
    backbone: Any = selected.get("backbone")
    for path in ("sampler", "eval.sampler"):
        chosen = selected.get(path)
        if backbone is None or chosen is None:
            continue
        predicts, steps_on = backbone.meta.get("prediction"), chosen.meta.get("prediction")
        if predicts and steps_on and predicts != steps_on:
            errors.append(
                f"{path} {chosen.name!r} steps on {steps_on} predictions, but backbone {backbone.name!r} predicts "
                f"{predicts}: choose one of {', '.join(_names(pm, 'sampler', prediction=predicts))}"
            )
    media = backbone.meta.get("media_kind") if backbone is not None else None
    rewards: list[Any] = [s for s in selected.get("rewards") or [] if s is not None]
    for path, chosen in [
        *((f"rewards.{i}", r) for i, r in enumerate(rewards)),
        *((f"monitor.gold.{i}", g) for i, g in enumerate(selected.get("monitor.gold") or [])),
    ]:
        kinds = chosen.meta.get("kinds") if chosen is not None else None
        if media and kinds and media not in kinds:
            fits = [c.name for c in pm.registry.all() if c.kind == "reward" and media in (c.meta.get("kinds") or ())]
            errors.append(
                f"{path}: reward {chosen.name!r} scores {'/'.join(sorted(kinds))}, but backbone "
                f"{backbone.name!r} makes {media}: choose one of {', '.join(sorted(fits)) or '(none registered)'}"
            )
    return errors


def _objective_checks(core: TrainConfig, selected: dict[str, Any], pm: PluginHost) -> list[str]:
    """The objective gets the transitions, log-probs and rollout shape it trains on, and so do the regularizers."""
    errors: list[str] = []
    backbone, sampler, objective = selected.get("backbone"), selected.get("sampler"), selected.get("objective")
    transitions: Any = backbone.meta.get("transitions") if backbone is not None else None
    for i, regularizer in enumerate(selected.get("regularizers") or []):
        if (
            regularizer is not None
            and objective is not None
            and regularizer.meta.get("requires_log_prob")
            and not objective.meta.get("requires_log_prob")
        ):
            replaying = [
                n
                for n in _names_for(pm, "objective", transitions)
                if pm.component("objective", n).meta.get("requires_log_prob")
            ]
            others = [
                n
                for n in _names_for(pm, "regularizer", transitions)
                if not pm.component("regularizer", n).meta.get("requires_log_prob")
            ]
            errors.append(
                f"regularizers.{i}: {regularizer.name!r} compares replayed sampler transitions, which "
                f"objective {objective.name!r} does not make: use an objective that replays them "
                f"({', '.join(replaying)}) or another regularizer ({', '.join(others)})"
            )
    if objective is not None and objective.meta.get("needs_tree_rollouts") and not core.rollout.branch_steps:
        errors.append(
            f"objective {objective.name!r} trains on tree rollouts: set rollout.branch_steps (e.g. [0, 3]) and "
            f"rollout.group_size to rollout.branch_width ** their number (e.g. 4)"
        )
    if objective is not None and sampler is not None:
        if objective.meta.get("requires_log_prob") and not sampler.meta.get("has_log_prob"):
            errors.append(
                f"objective {objective.name!r} needs per-transition log-probs, but sampler {sampler.name!r} is "
                f"deterministic: choose a stochastic sampler ({', '.join(_names(pm, 'sampler', has_log_prob=True))}) "
                f"or an objective that needs none ({', '.join(_names(pm, 'objective', requires_log_prob=False))})"
            )
    return errors


def _transition_checks(selected: dict[str, Any], pm: PluginHost, sampler_given: bool) -> list[str]:
    """A sampler exactly when the backbone's transitions are denoising steps; objectives and regularizers
    that train the transitions the backbone emits."""
    backbone = selected.get("backbone")
    if backbone is None:
        return []
    transitions, errors = backbone.meta.get("transitions"), []
    if transitions == "denoising" and not sampler_given:
        errors.append(
            f"missing value for 'sampler': backbone {backbone.name!r} takes its denoising steps from a sampler: "
            f"choose one of {', '.join(_names(pm, 'sampler'))}"
        )
    if transitions != "denoising":
        for path in ("sampler", "eval.sampler"):
            if selected.get(path) is not None:
                errors.append(
                    f"'{path}': backbone {backbone.name!r} emits {transitions} and samples them itself "
                    f"(its own options set how): remove the {path} section"
                )
    for path in ("objective", *(f"regularizers.{i}" for i in range(len(selected.get("regularizers") or [])))):
        chosen: Any = (
            selected.get("objective") if path == "objective" else selected["regularizers"][int(path.split(".")[1])]
        )
        trains = chosen.meta.get("transitions") if chosen is not None else None
        if trains and transitions and trains != transitions:
            kind = chosen.kind
            where = "" if path == "objective" else f"{path}: "
            errors.append(
                f"{where}{kind} {chosen.name!r} trains {trains} transitions, but backbone {backbone.name!r} "
                f"emits {transitions}: choose one of {', '.join(_names_for(pm, kind, transitions))}"
            )
    return errors


def _names_for(pm: PluginHost, kind: str, transitions: str) -> list[str]:
    """Components of ``kind`` that train ``transitions`` (or any)."""
    return sorted(
        c.name for c in pm.registry.all() if c.kind == kind and c.meta.get("transitions") in (None, transitions)
    ) or ["(none registered)"]


def _names(pm: PluginHost, kind: str, **capabilities: Any) -> list[str]:
    """Registered components of ``kind`` whose capabilities have the given values."""
    return sorted(
        c.name
        for c in pm.registry.all()
        if c.kind == kind
        and all(
            bool(c.meta.get(k)) == v if isinstance(v, bool) else c.meta.get(k) == v for k, v in capabilities.items()
        )
    ) or ["(none registered)"]


def _prompt_checks(core: TrainConfig) -> list[str]:
    """Prompts to train on, every record source readable with its prompt column; and when eval prompts are given,
    enough eval samples for each to be sampled twice (in-group diversity, and the collapse monitor that reads it,
    compare a prompt's samples)."""
    from gyremedia.data import RECORD_SUFFIXES, PromptFileError, read_dataset, read_prompts

    errors = []
    data, ev = core.data, core.eval
    if not data.prompts and not data.prompts_file and not data.dataset:
        errors.append(
            "no prompts: set data.prompts (a list, e.g. data.prompts=[a cat, a dog]), data.prompts_file or data.dataset"
        )
    blank = [i for i, p in enumerate(data.prompts) if not str(p).strip()]
    if blank:
        errors.append(f"data.prompts.{blank[0]} is blank: remove it, or write a prompt")
    read = {}
    for key, value, reader in [
        ("data.prompts_file", data.prompts_file, lambda v: read_prompts(v, data.prompt_column)),
        ("data.dataset", data.dataset, lambda v: read_dataset(v, data.split, data.prompt_column)),
        ("eval.prompts_file", ev.prompts_file, lambda v: read_prompts(v, data.prompt_column)),
        ("eval.dataset", ev.dataset, lambda v: read_dataset(v, ev.split, data.prompt_column)),
    ]:
        if not value or not (key.endswith("dataset") or Path(value).expanduser().is_file()):  # missing: its own check
            continue
        # a text file's problems are its option check's to report; records need the prompt column to be read
        records = key.endswith("dataset") or Path(value).suffix.lower() in RECORD_SUFFIXES
        try:
            read[key] = reader(value)
        except PromptFileError as exc:
            if records:
                errors.append(f"{key}={value!r}: {exc}")
            continue
        if not read[key] and records:
            errors.append(f"{key}={value!r}: holds no prompt (no record has text under {data.prompt_column!r})")
    if errors:
        return errors
    eval_prompts: Sequence[str]
    if ev.prompts_file or ev.dataset:
        eval_prompts = read.get("eval.prompts_file", []) + read.get("eval.dataset", [])
        key = "eval.prompts_file" if ev.prompts_file else "eval.dataset"
    elif data.eval_prompts:
        eval_prompts, key = list(data.eval_prompts), "data.eval_prompts"
    else:
        return errors  # evaluation cycles through as many training prompts as eval.samples covers
    distinct = len(dict.fromkeys(eval_prompts))
    if distinct and ev.samples < 2 * distinct:
        errors.append(
            f"eval.samples={ev.samples} leaves some of the {distinct} eval prompts ({key}) with one sample; "
            f"in-group diversity and the collapse monitor compare two or more per prompt: set "
            f"eval.samples>={2 * distinct}, or evaluate fewer prompts (eval.prompts_file)"
        )
    return errors

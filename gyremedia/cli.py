"""``gyremedia train | eval | export | config | plugins | serve-reward``: every run is a yaml plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from importlib import resources
from pathlib import Path
from typing import Any, cast

from gyremedia.config import ConfigError, ResolvedConfig, load_config, resolve_config
from gyremedia.plugins import PluginError, PluginManager

DEFAULT_CONFIG = "quickstart.yaml"


def bundled_config(name: str) -> Path:
    """A config shipped with the package (the repository's ``configs/`` folder)."""
    return Path(str(resources.files("gyremedia.configs") / name))


def bundled_names() -> list[str]:
    """The names of the configs shipped with the package (``gyremedia train NAME``)."""
    return sorted(
        p.name.removesuffix(".yaml") for p in resources.files("gyremedia.configs").iterdir() if p.name.endswith(".yaml")
    )


def _resolve(config_path: str | None, overrides: list[str], pm: PluginManager) -> ResolvedConfig:
    if config_path is None:
        config_path = str(bundled_config(DEFAULT_CONFIG))
    elif not Path(config_path).is_file():
        shipped = bundled_config(config_path if config_path.endswith(".yaml") else config_path + ".yaml")
        if not shipped.is_file():
            hint = (
                "; an override looks like key=value"
                if "=" not in config_path
                and "." in config_path.strip(".")
                and not config_path.endswith((".yaml", ".yml"))
                else ""
            )
            raise ConfigError(
                f"config file {config_path!r} not found (nor among the bundled configs: "
                f"{', '.join(bundled_names())}){hint}"
            )
        config_path = str(shipped)
    return resolve_config(load_config(config_path, overrides), pm)


def _split_args(values: list[str]) -> tuple[str | None, list[str]]:
    """The first value is the config file unless it is already a ``key=value`` override."""
    if values and "=" not in values[0]:
        return values[0], values[1:]
    return None, values


def cmd_train(args: argparse.Namespace) -> int:
    from gyremedia.runtime.runs import quiet_libraries, run_config
    from gyremedia.trainer import Trainer

    pm = PluginManager()
    config_path, overrides = _split_args(args.args)
    if args.resume:
        if config_path is not None:
            raise ConfigError("with --resume the config is the run's own; pass only key=value overrides")
        config = run_config(Path(args.resume), overrides, pm)
    else:
        config = _resolve(config_path, overrides, pm)
    if args.override_resumed and not args.resume:
        raise ConfigError("--override-resumed goes with --resume RUN_DIR: a new run takes any setting")
    trainer = Trainer(config, pm, resume=bool(args.resume), override_resumed=args.override_resumed)
    quiet_libraries()
    state = trainer.train()
    if state.accelerator.is_main_process:
        print("\n".join(trainer.summary()))
    state.accelerator.wait_for_everyone()
    state.accelerator.end_training()  # every process leaves the process group together, then exits
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from gyremedia.offline import write_rollouts
    from gyremedia.runtime.runs import quiet_libraries
    from gyremedia.trainer import Trainer

    pm = PluginManager()
    config_path, overrides = _split_args(args.args)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: give a new folder (saved rollouts are never mixed)")
    config = _resolve(config_path, [*overrides, f"run.output_dir={out}", "logging.loggers=[]"], pm)
    if config.core.data.offline is not None:
        raise ConfigError("data.offline trains on saved rollouts; `gyremedia rollout` writes them: leave it unset")
    trainer = Trainer(config, pm)
    quiet_libraries()
    lines = write_rollouts(trainer, out, args.steps, args.trajectories)
    if trainer.accelerator.is_main_process:
        print("\n".join(lines))
    trainer.accelerator.end_training()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out score of the base model and of the trained one: same prompts, same seeds."""
    from gyremedia import evaluation
    from gyremedia.runtime import runs

    pm = PluginManager()
    config = runs.run_config(Path(args.run_dir), args.overrides, pm)
    runs.quiet_libraries()
    backbone = runs.build_backbone(config, pm)
    sampler, rewards = runs.build_scoring(config, pm)
    key, preference = evaluation.accuracy_key(config), pm.hook.gyremedia_eval_preference(config=config)
    results = {}
    for label in ("base", "trained"):
        if label == "trained":
            checkpoint = runs.load_trained_weights(backbone, Path(args.run_dir))
        result = evaluation.evaluate(config, backbone, sampler, rewards, preference=preference)
        if key not in result.scores:
            raise ConfigError(f"eval.metric={key!r} is not among the scores: {', '.join(sorted(result.scores))}")
        results[label] = result
    report = _eval_report(results, key)
    report["checkpoint"] = str(checkpoint)
    # what plugins add (a Pareto run's front): into the report, and lines to print after the table
    extra = [
        line
        for lines in pm.hook.gyremedia_eval_report(
            config=config, backbone=backbone, sampler=sampler, rewards=rewards, report=report
        )
        for line in lines or []
    ]
    if args.json:
        print(json.dumps(report))
        return 0
    _print_eval_report(report, results, key)
    for line in extra:
        print(line)
    return 0


def _eval_report(results: dict[str, Any], key: str) -> dict[str, Any]:
    """The base and trained models' means, the paired gain in ``key`` and every score's paired difference."""
    from gyremedia import evaluation

    prefix = key.split("/")[0] + "/"
    report: dict[str, Any] = {
        label: {
            "accuracy": evaluation.nanmean(r.scores[key]),
            **{
                k[len(prefix) :]: evaluation.nanmean(v)
                for k, v in r.scores.items()
                if k.startswith(prefix) and k != key
            },
            "diversity": evaluation.in_group_diversity(r.media, r.prompts),
        }
        for label, r in results.items()
    }
    gold = sorted(k for k in results["base"].scores if k.startswith("gold/"))
    if gold:  # held-out rewards the run never trained on: did the gain cost them?
        report["gold"] = {
            k[len("gold/") :]: {label: evaluation.nanmean(r.scores[k]) for label, r in results.items()} for k in gold
        }
    report["gain"] = evaluation.paired_gain(results["base"].scores[key], results["trained"].scores[key])
    # every score (rewards, their parts, gold rewards), trained minus base over the same samples
    report["differences"] = {
        k: evaluation.paired_difference(results["base"].scores[k], results["trained"].scores[k])
        for k in sorted(results["base"].scores)
        if k in results["trained"].scores
    }
    report["metric"] = key
    report["samples"] = len(results["base"].prompts)
    return report


def _print_eval_report(report: dict[str, Any], results: dict[str, Any], key: str) -> None:
    from gyremedia import evaluation

    gain = report["gain"]
    print(f"{key} on {report['samples']} fixed-seed samples of the eval prompts ({report['checkpoint']})")
    rows = {
        **{name: (report["base"][name], report["trained"][name]) for name in report["base"]},
        **{f"gold/{name}": (v["base"], v["trained"]) for name, v in report.get("gold", {}).items()},
    }
    width = max(map(len, rows)) + 2
    print(f"{'':<{width}}{'base':>10}{'trained':>10}")
    for name, (base, trained) in rows.items():
        print(f"{name:<{width}}{base:>10.3f}{trained:>10.3f}")
    print(f"gain: {gain['points']:+.1f} points (95% CI {gain['ci95_low']:+.1f} to {gain['ci95_high']:+.1f}, paired)")
    width = max(map(len, report["differences"])) + 2
    print(
        f"\nevery score, trained - base (paired 95% interval):\n{'':<{width}}{'base':>10}{'trained':>10}{'change':>10}"
    )
    for name, d in report["differences"].items():
        base, trained = (
            evaluation.nanmean(results["base"].scores[name]),
            evaluation.nanmean(results["trained"].scores[name]),
        )
        print(
            f"{name:<{width}}{base:>10.4g}{trained:>10.4g}{d['mean']:>+10.4g}  ({d['ci95_low']:+.4g} to {d['ci95_high']:+.4g})"
        )


def cmd_export(args: argparse.Namespace) -> int:
    """Write the trained generator where its library's stock loader reads it."""
    from gyremedia.runtime import runs

    pm = PluginManager()
    config = runs.run_config(Path(args.run_dir), [], pm)
    if args.lora_only and not config.backbone.options.lora.enabled:
        raise ConfigError("--lora-only: this run trained the full model (backbone.lora.enabled=false)")
    runs.check_export_folder(Path(args.out_dir), Path(args.run_dir), args.overwrite)
    runs.quiet_libraries()
    backbone = runs.build_backbone(config, pm)
    checkpoint = runs.load_trained_weights(backbone, Path(args.run_dir))
    runs.export_whole(backbone, Path(args.out_dir), merge_lora=not args.lora_only)
    print(f"exported {checkpoint} to {args.out_dir}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    config_path, overrides = _split_args(args.args)
    print(_resolve(config_path, overrides, PluginManager()).to_yaml(), end="")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    pm = PluginManager()
    rows = pm.describe()
    failed = [{"plugin": f.name, "package": f.distribution, "error": f.error} for f in pm.failed]
    if args.json:
        print(json.dumps({"plugins": rows, "failed": failed}, indent=2))
        return 0
    for row in rows:
        print(f"{row['plugin']}  (package {row['package']})")
        for item in row["registers"]:
            kind, name = item.split(":", 1)
            description = pm.registry.get(kind, name).meta.get("description", "")
            print(f"    {kind:<12}{name:<24}{description}")
        if row["hooks"]:
            print(f"    hooks: {', '.join(row['hooks'])}")
    for item in failed:
        print(f"FAILED {item['plugin']}  (package {item['package']}): {item['error']}")
    return 0


def cmd_serve_reward(args: argparse.Namespace) -> int:
    """Serve one registered reward over HTTP (see :mod:`gyremedia.reward_server`) until interrupted."""
    import torch
    from omegaconf import OmegaConf

    from gyremedia.config import select_component
    from gyremedia.interfaces import BuildContext
    from gyremedia.reward_server import RewardService, listen, server, url

    pm = PluginManager()
    try:
        options = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.from_dotlist(args.options)))
    except Exception as exc:  # noqa: BLE001 - omegaconf's parse errors name the bad item
        raise ConfigError(f"reward options: {exc} (give key=value, e.g. batch_size=8)") from exc
    selected = select_component(pm, "reward", {"name": args.name, **options}, "reward")
    reward = pm.build(selected, BuildContext(device=torch.device(args.device)))
    sock = listen(args.host, args.port)
    print(f"serving reward {selected.name!r} on {url(sock)}", flush=True)
    server(RewardService(selected.name, reward, args.max_batch, args.batch_wait)).run(sockets=[sock])
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the full traceback of an error instead of its one-line message",
    )
    parser = argparse.ArgumentParser(prog="gyremedia", description=__doc__, parents=[common])
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser(
        "train", parents=[common], help="train from a yaml (default: the quickstart) plus key=value overrides"
    )
    train.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last complete checkpoint")
    train.add_argument(
        "--override-resumed",
        metavar="KEY",
        action="append",
        default=[],
        help="with --resume: let KEY (or a whole section) differ from the settings the run was trained "
        "with, e.g. --override-resumed train.learning_rate (repeatable; docs/errors.md)",
    )
    train.set_defaults(func=cmd_train)
    _add_run_commands(commands, common)
    return parser


def _add_run_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """The commands that read a config or a run folder: config, rollout, eval, export, plugins, serve-reward."""
    config = commands.add_parser(
        "config", parents=[common], help="validate a config and print it with every default filled in"
    )
    config.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    config.set_defaults(func=cmd_config)
    _add_rollout_command(commands, common)
    evaluate = commands.add_parser(
        "eval", parents=[common], help="held-out score of the base and trained models, with a 95%% interval"
    )
    evaluate.add_argument("run_dir")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.samples=512")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object: base, trained, gain")
    evaluate.set_defaults(func=cmd_eval)
    export = commands.add_parser(
        "export", parents=[common], help="write the trained model as a diffusers pipeline folder"
    )
    export.add_argument("run_dir")
    export.add_argument("out_dir")
    export.add_argument(
        "--lora-only",
        action="store_true",
        help="save only the LoRA adapters, for pipe.load_lora_weights (default: merged weights)",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace what OUT_DIR holds (refused by default when it is not empty)"
    )
    export.set_defaults(func=cmd_export)
    plugins = commands.add_parser(
        "plugins", parents=[common], help="list plugins, what they register and the hooks they implement"
    )
    plugins.add_argument("--json", action="store_true", help="print one JSON object")
    plugins.set_defaults(func=cmd_plugins)
    served = commands.add_parser(
        "serve-reward",
        parents=[common],
        help="serve a registered reward over HTTP for the 'remote' reward (its own process and environment)",
    )
    served.add_argument("name", help="the registered reward (see `gyremedia plugins`)")
    served.add_argument("options", nargs="*", metavar="key=value", help="the reward's options")
    served.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default: loopback only; 0.0.0.0 serves every network this machine is on)",
    )
    served.add_argument("--port", type=int, default=8000, help="the port (0: any free one, printed at start)")
    served.add_argument("--device", default="cuda" if _has_cuda() else "cpu", help="where the reward's model runs")
    served.add_argument("--max-batch", type=int, default=64, help="samples scored in one call at most")
    served.add_argument(
        "--batch-wait", type=float, default=0.005, help="seconds a request waits for others to be scored with it"
    )
    served.set_defaults(func=cmd_serve_reward)


def _add_rollout_command(commands: Any, common: argparse.ArgumentParser) -> None:
    rollout = commands.add_parser(
        "rollout",
        parents=[common],
        help="sample and score a config's rollouts once, into a folder to train on offline (data.offline=DIR)",
    )
    rollout.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    rollout.add_argument("--out", required=True, help="the folder to write (new or empty)")
    rollout.add_argument("--steps", type=int, default=8, help="steps of rollout.batch_size samples to write")
    rollout.add_argument(
        "--trajectories",
        action="store_true",
        help="keep whole trajectories and log-probs (for replaying objectives), not only the final samples",
    )
    rollout.set_defaults(func=cmd_rollout)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if args.command is None:  # `gyremedia` alone trains the quickstart, like `gyremedia train`
        args, extra = parser.parse_known_args(["train", *argv])
    # key=value overrides may follow options (`eval RUN --json eval.samples=512`): argparse leaves them over.
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    positional = next((name for name in ("overrides", "options", "args") if hasattr(args, name)), "args")
    if extra:
        setattr(args, positional, [*getattr(args, positional), *extra])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve-reward":  # in a reward's own environment, which may lack what training imports
        return _one_line_errors(args, (ConfigError, PluginError))
    from gyremedia.runtime.checkpoint import CheckpointError
    from gyremedia.runtime.distributed import FailedElsewhere
    from gyremedia.scoring import RewardError
    from gyremedia.trainer import Interrupted, NonFiniteLoss

    # Errors a user can act on print one line (the key and the fix) and their class's exit code (the table in
    # docs/errors.md); --debug shows the traceback.
    return _one_line_errors(
        args, (ConfigError, PluginError, RewardError, NonFiniteLoss, CheckpointError, Interrupted, FailedElsewhere)
    )


def _one_line_errors(args: argparse.Namespace, actionable: tuple[type[Exception], ...]) -> int:
    """Run the command; an error of an ``actionable`` class prints one line and returns its exit code."""
    try:
        return args.func(args)
    except actionable as exc:
        if getattr(args, "debug", False):
            raise
        # one write of the whole line: the processes of a run share stderr, and print's separate write of the
        # newline (unbuffered, PYTHONUNBUFFERED=1) let another process's line land in the middle of this one
        sys.stderr.write(f"gyremedia: error: {exc}\n")
        sys.stderr.flush()
        return getattr(exc, "exit_code", 1)


def exit_cleanly(code: int) -> None:
    """Exit the process with ``code``, the same code every time.

    A daemon thread still running torch work when the interpreter tears down (the next step's prompt prefetch, a
    reward call, one hung past its ``timeout``), or the gloo threads of a process group left undestroyed after an
    error, can abort the teardown ("terminate called without an active exception", exit 134 instead of 1). So
    background work gets a few seconds to end; if any is left, or a process group is still up, the process exits
    without the teardown, once its output is flushed."""
    import torch.distributed

    from gyremedia.runtime.threads import wait_for_background

    settled = wait_for_background(timeout=10.0)
    if settled and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> None:
    """The ``gyremedia`` command: every way out of :func:`main` (a traceback included) goes through
    :func:`exit_cleanly`."""
    code = 1
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors, --help
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # outside the training loop, which handles it itself
        code = 130
    except BaseException:  # noqa: BLE001 - shown as Python would, then the same exit
        traceback.print_exc()
    exit_cleanly(code)


if __name__ == "__main__":
    run()

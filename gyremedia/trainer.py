"""The loop: the order of a run's stages and the bookkeeping every run needs, on an accelerate ``Accelerator``.

One step is a sequence of stage hooks (their defaults in :mod:`gyremedia.stages`): collect the rollout -> score
it -> compute advantages over all ranks -> update -> (evaluate) -> save. Features (candidate pools, Pareto
preferences, the per-prompt reward history, forward reuse, the hacking monitor) are plugins on those hooks
(``plugins/gyremedia_features``); this file names none of them. docs/architecture.md draws the data flow.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from gyremedia import evaluation
from gyremedia.config import ConfigError, ResolvedConfig
from gyremedia.interfaces import BuildContext, Compilable, Prefetching, Shardable
from gyremedia.registry import PluginHost
from gyremedia.rollout import Rollout
from gyremedia.runtime import checkpoint as ckpt
from gyremedia.runtime.distributed import any_rank, raise_together
from gyremedia.runtime.runs import RESOLVED_CONFIG
from gyremedia.runtime.signals import Interrupted, StopSignals
from gyremedia.scoring import RewardError  # noqa: F401 - part of this module's API
from gyremedia.stages import build, checkpointing, finish, rollout, scoring
from gyremedia.stages.build import check_process_layout, resolve_sharding  # noqa: F401 - part of this module's API
from gyremedia.stages.update import NonFiniteLoss  # noqa: F401 - part of this module's API
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


def _create_accelerator() -> Any:
    from accelerate import Accelerator

    # Without an accelerator device, accelerate runs several launched processes as gloo ranks
    # (MULTI_CPU) only when told to use the CPU.
    return Accelerator(cpu=not torch.accelerator.is_available())


class Trainer:
    """Builds the selected components and runs the loop; ``Trainer(config, pm).train()``."""

    def __init__(
        self,
        config: ResolvedConfig,
        plugins: PluginHost,
        *,
        resume: bool = False,
        override_resumed: list[str] | tuple[str, ...] = (),
        accelerator: Any = None,
    ) -> None:
        self.config, self.core = config, config.core
        self.accelerator = accelerator or _create_accelerator()
        check_process_layout(config, self.accelerator.num_processes)
        sharded = resolve_sharding(config, self.accelerator)
        self.run_dir = Path(self.core.run.output_dir)
        self.resume = resume
        if not resume and ckpt.list_checkpoints(self.run_dir):
            raise ConfigError(
                f"run.output_dir={str(self.run_dir)!r} already holds checkpoints: resume it with "
                f"`gyremedia train --resume {self.run_dir}` or set run.output_dir to a new folder"
            )
        if resume:
            checkpointing.check_resumed_settings(self.run_dir, config, override_resumed)
        self.state = TrainState(
            config=config,
            accelerator=self.accelerator,
            run_dir=self.run_dir,
            plugins=plugins,
            sharded=sharded,
            prompts=evaluation.training_prompts(config),
        )
        # With async scoring: the next step's rollout, sampled and being scored. Not checkpointed: a
        # resumed run samples it again with the restored policy.
        self._pending: dict[int, tuple[Rollout, dict[str, Any], float]] = {}
        self.signals = StopSignals()
        self._started = time.monotonic()

    def setup(self) -> TrainState:
        """Write the resolved config, build components, prepare with accelerate, maybe resume."""
        from accelerate.utils import set_seed

        acc, state = self.accelerator, self.state
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_atomically(self.run_dir / RESOLVED_CONFIG, self.config.to_yaml().encode())
        acc.wait_for_everyone()
        set_seed(self.core.run.seed, device_specific=True)
        state.plugins.hook.gyremedia_configure(config=self.config, accelerator=acc)
        context = BuildContext(
            device=acc.device,
            run_dir=self.run_dir,
            accelerator=acc,
            seed=self.core.run.seed,
            is_main_process=acc.is_main_process,
            mixed_precision=self.core.train.mixed_precision,
        )
        build.build_components(state, context)
        # A checkpoint's weights go in before sharding; its optimizer state once the optimizer exists.
        loaded = checkpointing.read_checkpoint(state) if self.resume else None
        if loaded is not None:
            state.backbone.load_trainable_state_dict(loaded.weights)
        if state.sharded:
            blocks = cast(Shardable, state.backbone).shard()  # resolve_sharding checked it declares shardable
            logger.info("FSDP2: the model is sharded over %d processes by %d blocks", acc.num_processes, blocks)
        if self.core.train.compile:  # after sharding: the blocks' all-gathers run around the compiled graphs
            cast(Compilable, state.backbone).compile()  # the config checked it declares compilable
            logger.info(
                "train.compile: the first rollout, update and evaluation compile the model (a minute or "
                "more on a CPU); later ones run compiled"
            )
        build.build_optimizer(state)
        if loaded is not None:
            checkpointing.resume(state, loaded)
        return state

    def sample_and_submit(self, step: int) -> tuple[Rollout, dict[str, Any], float]:
        """Sample step ``step``'s rollout and start scoring it; returns it, its reward futures, the seconds taken."""
        start = time.perf_counter()
        sampled = rollout.collect(self.state, step)
        self.state.plugins.hook.gyremedia_after_rollout(state=self.state, rollout=sampled)
        futures = scoring.start_scoring(self.state, sampled)
        return sampled, futures, time.perf_counter() - start

    def train_step(self, step: int) -> dict[str, float]:
        """Sample (or take the rollout sampled during the last step), score, compute advantages, update.

        With ``rollout.async_scoring`` the next step's rollout is sampled while this one's rewards
        run in their worker threads, so a slow reward costs only what sampling does not hide.
        """
        state, hook, last = self.state, self.state.plugins.hook, self.core.train.steps
        pending = self._pending.pop(step, None)
        sampled, futures, seconds = pending or self.sample_and_submit(step)
        if self.config.backbone.meta.get("prefetches") and step + 1 < last:  # it encodes the next prompts meanwhile
            cast(Prefetching, state.backbone).prefetch(rollout.rollout_request(state, step + 1).prompts)
        times = {"time/rollout": seconds}
        if self.core.rollout.async_scoring and step + 1 < last:
            self._pending[step + 1] = upcoming = self.sample_and_submit(step + 1)
            times["time/rollout"] = upcoming[2]
        start = time.perf_counter()
        metrics = hook.gyremedia_score_rollout(state=state, rollout=sampled, futures=futures, step=step)
        metrics.update(hook.gyremedia_compute_advantages(state=state, rollout=sampled, step=step))
        metrics.update(sampled.metrics)
        times["time/reward"], start = time.perf_counter() - start, time.perf_counter()
        metrics.update(hook.gyremedia_update(state=state, rollout=sampled, step=step))
        times["time/train"] = time.perf_counter() - start
        state.rollout = sampled
        return metrics | times

    def evaluate(self, step: int) -> dict[str, float]:
        """The evaluation stage at ``step`` (``gyremedia_evaluate``)."""
        return self.state.plugins.hook.gyremedia_evaluate(state=self.state, step=step)

    def save(self) -> Path:
        """The checkpoint stage (``gyremedia_save_checkpoint``) at the current step, on every rank."""
        return self.state.plugins.hook.gyremedia_save_checkpoint(state=self.state)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.state.loggers:
            sink.log(metrics, step)

    def train(self) -> TrainState:
        """Run from the current step to ``train.steps``; returns the final state.

        A SIGTERM or SIGINT finishes the current step, writes a checkpoint and raises :class:`Interrupted`
        (a second one exits at once); ``checkpoint.max_lost_seconds`` bounds the work a kill can lose.
        """
        state = self.setup() if self.state.backbone is None else self.state
        self._started = time.monotonic()
        state.last_save = state.last_save or (state.step, time.monotonic())
        progress = tqdm(
            total=self.core.train.steps,
            initial=state.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (self.accelerator.is_main_process and self.core.logging.progress),
        )
        try:
            with self.signals.handled(lambda: state.step + 1):
                self._steps(progress)
                self.signals.finishing = True  # a signal now lets the export finish (the last checkpoint is written)
                error = None
                try:
                    state.plugins.hook.gyremedia_finish(state=state)
                except Exception as exc:  # noqa: BLE001 - re-raised on every process
                    error = exc
                raise_together(self.accelerator, error)
            state.plugins.hook.gyremedia_on_train_end(state=state)
        except BaseException as exc:
            state.plugins.hook.gyremedia_on_exception(state=state, exc=exc)
            raise
        finally:
            progress.close()
            for sink in state.loggers:
                sink.close()
        return state

    def _steps(self, progress: Any) -> None:
        """Every remaining step: train, evaluate when due, report, checkpoint when due or asked to stop."""
        state, total, every = self.state, self.core.train.steps, self.core.checkpoint.every
        if state.step == 0:
            self._log(self.evaluate(0), 0)
        while state.step < total:
            metrics = self.train_step(state.step)
            state.step += 1
            metrics["step"] = state.step
            if state.step == total or (self.core.eval.every and state.step % self.core.eval.every == 0):
                metrics.update(self.evaluate(state.step))
            state.plugins.hook.gyremedia_on_step_end(state=state, metrics=metrics)
            state.last_metrics = metrics
            self._log(metrics, state.step)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward']:.4f}", loss=f"{metrics['loss']:.4g}")
            stop, overdue = any_rank(self.accelerator, self.signals.received is not None, self._save_overdue())
            if state.step % every == 0 or state.step == total or overdue or stop:
                self.save()
            if stop:
                checkpoint = self.run_dir / ckpt.CHECKPOINT_DIR / ckpt.checkpoint_name(state.step)
                raise Interrupted(self.signals.received or signal.SIGTERM, state.step, checkpoint, self.run_dir)

    def _save_overdue(self) -> bool:
        """Whether ``checkpoint.max_lost_seconds`` have passed since the last checkpoint."""
        limit, last = self.core.checkpoint.max_lost_seconds, self.state.last_save
        return bool(limit) and last is not None and time.monotonic() - last[1] >= limit

    def summary(self) -> list[str]:
        """What a finished run learned and where its artifacts are (main process), a few lines for the terminal."""
        return finish.summary_lines(self.state, time.monotonic() - self._started)

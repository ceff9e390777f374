"""``gyremedia train`` with a reward that fails on one process at one training step, for the tests of what a failing
reward does to the exit code and to the other processes.

``python reward_failure_worker.py RANK STEP raise|nan train CONFIG key=value ...``: the reward (``fails_at_step``,
the images' brightness) raises, or scores NaN, on process RANK at training step STEP (evaluations, of another
batch size than a training batch, always score).
"""

import sys

import torch

import gyremedia.cli
from gyremedia import hookimpl


class FailsAtStep:
    kinds = {"image"}

    def __init__(self, rank: int, step: int, how: str, batch: int) -> None:
        self.rank, self.step, self.how, self.batch, self.calls = rank, step, how, batch, 0

    def __call__(self, media, prompts):
        scores = media.data.float().mean(dim=(1, 2, 3))
        if len(prompts) != self.batch:  # an evaluation
            return scores
        self.calls += 1
        if (
            self.calls == self.step + 1
            and torch.distributed.is_initialized() == (self.rank > 0)
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == self.rank)
        ):
            if self.how == "raise":
                raise ConnectionError("judge unreachable")
            scores[0] = float("nan")
        return scores


def main(rank: str, step: str, how: str, *args: str) -> int:
    class Plugin:
        @hookimpl
        def gyremedia_register_rewards(self, register):
            def build(context):
                processes = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
                batch = next(int(a.split("=")[1]) for a in args if a.startswith("rollout.batch_size="))
                return FailsAtStep(int(rank), int(step), how, batch // processes)

            register("fails_at_step", build, kinds={"image"})

    plain = gyremedia.cli.PluginManager
    gyremedia.cli.PluginManager = lambda: plain(extra_plugins=[Plugin()])
    return gyremedia.cli.main(list(args))


if __name__ == "__main__":
    gyremedia.cli.exit_cleanly(main(*sys.argv[1:]))

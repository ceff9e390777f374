"""The ``remote`` reward against ``gyremedia serve-reward`` on loopback: the same rewards as in-process, the
served name and kinds at config time, and a server killed (the run stops naming it, or drops) and restarted."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from cli_runs import free_port
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.reward_server import RewardService, listen, server, url
from gyremedia.rollout import Media
from gyremedia.scoring import RewardContractError, RewardError, Scorer
from gyremedia.trainer import Trainer


def start_server(name: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    """``gyremedia serve-reward NAME`` in a process of its own; returns it and its root once /health answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gyremedia.cli", "serve-reward", name, "--port", str(port), "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith(f"serving reward {name!r} on "), process.stderr.read()
    return process, line.split(" on ")[1].strip()


@pytest.fixture(scope="module")
def verifier_server():
    process, root = start_server("shapes_verifier")
    yield root
    process.kill()
    process.wait()


@pytest.fixture
def in_thread():
    """Serve a reward object from a thread of this process: ``in_thread(name, reward) -> root``."""
    running = []

    def start(name, reward):
        sock = listen("127.0.0.1", 0)
        uvicorn_server = server(RewardService(name, reward))
        threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not uvicorn_server.started:
            time.sleep(0.01)
        running.append(uvicorn_server)
        return url(sock)

    yield start
    for uvicorn_server in running:
        uvicorn_server.should_exit = True


def rewards_per_step(run_dir) -> list[tuple[float, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["reward/shapes_verifier"], r["reward/shapes_verifier/correct"], r["reward/shapes_verifier/colour"])
        for r in rows
        if "reward/shapes_verifier" in r
    ]


def test_a_served_reward_trains_as_the_same_reward_in_process(make_config, tmp_path, verifier_server):
    steps = ("train.steps=2",)
    Trainer(
        make_config("rewards=[shapes_verifier]", f"run.output_dir={tmp_path / 'local'}", *steps), PluginManager()
    ).train()
    remote = make_config(
        f"rewards=[{{name: remote, url: '{verifier_server}'}}]",
        f"run.output_dir={tmp_path / 'served'}",
        "eval.metric=shapes_verifier/correct",
        *steps,
    )
    assert remote.rewards[0].name == "shapes_verifier" and remote.rewards[0].meta["kinds"] == {"image"}
    Trainer(remote, PluginManager()).train()
    local, served = rewards_per_step(tmp_path / "local"), rewards_per_step(tmp_path / "served")
    assert len(local) == 2 and served == local


def test_the_config_asks_the_server_or_is_told(make_config):
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        ConfigError,
        match=rf"rewards.0.url='{closed}': no reward server answers at {closed}/health.*"
        "gyremedia serve-reward NAME",
    ):
        make_config(f"rewards=[{{name: remote, url: '{closed}'}}]")
    told = make_config(f"rewards=[{{name: remote, url: '{closed}', reward: judge, kinds: [image]}}]")
    assert told.rewards[0].name == "judge" and told.rewards[0].component == "remote"
    assert told.rewards[0].as_dict()["name"] == "remote"  # the saved config selects the plugin again
    with pytest.raises(
        ConfigError, match="rewards.0: reward 'judge' scores audio, but backbone 'flow_matching' makes image"
    ):
        make_config(f"rewards=[{{name: remote, url: '{closed}', reward: judge, kinds: [audio]}}]")


def scorer_of(config, plugin_manager) -> Scorer:
    return Scorer(config.rewards, {s.name: plugin_manager.build(s, None) for s in config.rewards})


def test_a_killed_server_stops_the_run_naming_it_or_drops_and_a_restarted_one_is_picked_up(make_config, plugin_manager):
    port = free_port()
    process, root = start_server("shapes_verifier", port)
    media, prompts = Media("image", torch.rand(3, 3, 16, 16)), ["a red circle", "a blue square", "a green triangle"]
    scorers = {
        policy: scorer_of(
            make_config(f"rewards=[{{name: remote, url: '{root}', retries: 1, backoff: 0.05, on_failure: {policy}}}]"),
            plugin_manager,
        )
        for policy in ("fail", "drop")
    }
    for scorer in scorers.values():
        assert not scorer.collect(scorer.submit(media, prompts), prompts, 0).dropped["shapes_verifier"].any()
    process.kill()
    process.wait()
    with pytest.raises(
        RewardError, match=f"reward 'shapes_verifier' failed at step 1 .*reward server at {root} after 2 attempts"
    ):
        scorers["fail"].collect(scorers["fail"].submit(media, prompts), prompts, 1)
    assert scorers["drop"].collect(scorers["drop"].submit(media, prompts), prompts, 1).dropped["shapes_verifier"].all()
    process, _ = start_server("shapes_verifier", port)
    try:
        for scorer in scorers.values():
            assert not scorer.collect(scorer.submit(media, prompts), prompts, 2).dropped["shapes_verifier"].any()
    finally:
        process.kill()
        process.wait()


class Raising:
    kinds = {"image"}

    def __call__(self, media, prompts):
        raise KeyError("no 'answer' field in the record")


class NoScore:
    kinds = {"image"}

    def __call__(self, media, prompts):
        return {"value": torch.zeros(len(prompts))}


def test_the_served_rewards_own_errors_come_back_named(make_config, plugin_manager, in_thread):
    media, prompts = Media("image", torch.rand(2, 3, 4, 4)), ["a", "b"]
    for reward, error, message in [
        (Raising(), RewardError, r"raised KeyError: \"no 'answer' field in the record\""),
        (NoScore(), RewardContractError, "returned keys \\['value'\\] without a 'score'"),
    ]:
        root = in_thread("custom", reward)
        scorer = scorer_of(make_config(f"rewards=[{{name: remote, url: '{root}'}}]"), plugin_manager)
        with pytest.raises(error, match=f"reward server at {root} answered HTTP .*{message}"):
            scorer.collect(scorer.submit(media, prompts), prompts, 0)


def test_a_server_that_serves_another_reward_is_refused_at_the_first_call(make_config, plugin_manager, in_thread):
    root = in_thread("custom", Raising())
    config = make_config(f"rewards=[{{name: remote, url: '{root}', reward: judge, kinds: [image]}}]")
    scorer = scorer_of(config, plugin_manager)
    media, prompts = Media("image", torch.rand(2, 3, 4, 4)), ["a", "b"]
    with pytest.raises(
        RewardError, match=f"the server at {root} serves reward 'custom' of image media, but the run expects 'judge'"
    ):
        scorer.collect(scorer.submit(media, prompts), prompts, 0)

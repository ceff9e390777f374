"""The VLM judge client against a real HTTP server process on loopback (tests/plugins/judge_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from gyremedia.options import validate
from gyremedia.config import RewardSettings, Selected
from gyremedia.rollout import Media
from gyremedia.scoring import RewardError, Scorer
from gyremedia_rewards.vlm_judge import VlmJudge, VlmJudgeOptions


@pytest.fixture(scope="module")
def server():
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("judge_server.py"))],
                               stdout=subprocess.PIPE, text=True)
    port = int(process.stdout.readline())
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait()


def stats(server: str) -> dict:
    with urllib.request.urlopen(server + "/stats") as response:
        return json.loads(response.read())


def judge(server: str, **options) -> VlmJudge:
    defaults = {"base_url": server + "/v1", "model": "test-judge", "backoff": 0.05, "request_timeout": 1.0}
    return VlmJudge(VlmJudgeOptions(**{**defaults, **options}))


def grey(*levels: float) -> Media:
    return Media("image", torch.tensor(levels).view(-1, 1, 1, 1).expand(-1, 3, 8, 8).clone())


def test_scores_follow_the_judges_grades_and_respect_the_concurrency_limit(server):
    levels = [0.0, 0.2, 0.5, 0.8, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    before = stats(server)["requests"]
    scores = judge(server, max_concurrency=3)(grey(*levels), [f"sample {i}" for i in range(12)])["score"]
    torch.testing.assert_close(scores, torch.tensor(levels), atol=0.011, rtol=0)
    after = stats(server)
    assert after["requests"] - before == 12
    assert 2 <= after["max_in_flight"] <= 3


def test_server_errors_and_rate_limits_are_retried(server):
    scores = judge(server)(grey(0.3, 0.6), ["a flaky one", "a busy one"])["score"]
    torch.testing.assert_close(scores, torch.tensor([0.3, 0.6]), atol=0.011, rtol=0)


def test_unparseable_and_slow_replies_become_nan_after_retries(server):
    start = time.perf_counter()
    scores = judge(server, max_retries=1, request_timeout=0.5)(grey(0.5, 0.5, 0.5),
                                                               ["garbage reply", "a slow judge", "fine"])["score"]
    assert scores[0].isnan() and scores[1].isnan() and scores[2] == pytest.approx(0.5, abs=0.011)
    assert time.perf_counter() - start < 3  # two timed-out attempts, not the server's 3 s sleeps


def test_failure_policy_decides_what_a_bad_reply_does(server):
    reward = judge(server, max_retries=0)
    prompts = ["fine", "garbage again"]
    for policy in ("fail", "drop"):
        scorer = Scorer([Selected("reward", "vlm_judge", None, RewardSettings(on_failure=policy))], {"vlm_judge": reward})
        futures = scorer.submit(grey(0.4, 0.4), prompts)
        if policy == "fail":
            with pytest.raises(RewardError, match="on prompt 'garbage again': 'score' is nan"):
                scorer.collect(futures, prompts, step=3)
        else:
            scored = scorer.collect(futures, prompts, step=3)
            assert scored.dropped["vlm_judge"].tolist() == [False, True]


def test_a_refused_request_is_not_retried_and_says_why(server):
    with pytest.raises(RuntimeError, match="refused the request: HTTP 400"):
        judge(server)(grey(0.5), ["badrequest"])


def test_unreachable_server_gives_nan_not_zero():
    reward = VlmJudge(VlmJudgeOptions(base_url="http://127.0.0.1:9/v1", max_retries=1, backoff=0.01, request_timeout=0.5))
    assert reward(grey(0.5), ["anything"])["score"].isnan().all()


def test_rubric_must_name_the_prompt():
    assert "must contain {prompt}" in validate(VlmJudgeOptions(rubric="Rate this image."))[0]


def test_text_answers_are_judged_as_an_llm_judge(server):
    reward = judge(server)
    scores = reward(Media("text", ["one two three", "a b c d e f g"]), ["count", "letters"])["score"]
    torch.testing.assert_close(scores, torch.tensor([0.3, 0.7]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("url,env,extra,error", [
    ("http://127.0.0.1:8000/v1", {}, {}, None),  # a keyless local server stays the default
    ("http://localhost:8000/v1", {"OPENAI_API_KEY": "k"}, {}, None),
    ("https://judge.example.com/v1", {}, {}, None),  # a missing key is the run's problem (below), not the config's
    ("https://judge.example.com/v1", {"OPENAI_API_KEY": "k"}, {}, None),
    ("http://10.1.2.3:8000/v1", {"OPENAI_API_KEY": "k"}, {},
     "base_url='http://10.1.2.3:8000/v1': http://10.1.2.3:8000/v1 would send the key in OPENAI_API_KEY unencrypted to "
     "another machine: use https://, or set allow_insecure_key: true"),
    ("http://10.1.2.3:8000/v1", {"OPENAI_API_KEY": "k"}, {"allow_insecure_key": True}, None),
    ("http://judge-node:8000/v1", {}, {"api_key_env": ""}, None),  # a server elsewhere that takes no key
])
def test_the_key_goes_only_over_https_or_to_loopback(monkeypatch, url, env, extra, error):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert validate(VlmJudgeOptions(base_url=url, **extra)) == ([error] if error else [])


def test_the_key_is_not_forwarded_when_the_judge_redirects_to_another_host(monkeypatch):
    """127.0.0.1 redirects to 127.0.0.2 (another host, same machine): the key stops at the first; a redirect on
    the same host keeps it."""
    import http.server
    import threading

    seen = []

    class Judge(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.do_GET()

        def do_GET(self):  # urllib follows a POST's 302 with a GET (as browsers do)
            seen.append((self.server.server_address[0], self.path, self.headers.get("Authorization")))
            if self.path.endswith("/redirect-away"):
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.2:{other.server_address[1]}/v1/chat/completions")
            elif self.path.endswith("/redirect-here"):
                self.send_response(302)
                self.send_header("Location", "/v1/chat/completions")
            else:
                body = json.dumps({"choices": [{"message": {"content": "7"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    first, other = (http.server.ThreadingHTTPServer((host, 0), Judge) for host in ("127.0.0.1", "127.0.0.2"))
    for server in (first, other):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    try:
        for route in ("redirect-away", "redirect-here"):
            client = judge(f"http://127.0.0.1:{first.server_address[1]}", max_retries=0)
            client.url = client.url.replace("chat/completions", route)
            assert client(grey(0.5), ["a prompt"])["score"].item() == pytest.approx(0.7)
    finally:
        first.shutdown()
        other.shutdown()
    assert seen == [("127.0.0.1", "/v1/redirect-away", "Bearer secret"), ("127.0.0.2", "/v1/chat/completions", None),
                    ("127.0.0.1", "/v1/redirect-here", "Bearer secret"),
                    ("127.0.0.1", "/v1/chat/completions", "Bearer secret")]


def test_a_run_with_a_remote_judge_and_no_key_stops_before_any_model_loads(make_config, monkeypatch):
    """Checked when training starts (gyremedia_configure), not with the options: `gyremedia export` and `config` of
    such a run need no key."""
    from gyremedia.config import ConfigError
    from gyremedia.plugins import PluginManager
    from gyremedia.trainer import Trainer

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = make_config("rewards=[{name: vlm_judge, base_url: 'https://judge.example.com/v1'}]")

    def refuse(*args, **kwargs):
        raise AssertionError("a component was built before the key was checked")

    monkeypatch.setattr(PluginManager, "build", refuse)
    with pytest.raises(ConfigError) as info:
        Trainer(config, PluginManager()).setup()
    assert str(info.value) == (
        "rewards.0.api_key_env='OPENAI_API_KEY': OPENAI_API_KEY is not set, and base_url=https://judge.example.com/v1 "
        "is not on this machine: export OPENAI_API_KEY=<key> before the run, or set api_key_env to '' for a server "
        "that takes no key")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    with pytest.raises(AssertionError, match="a component was built"):  # with the key, setup goes on to build
        Trainer(config, PluginManager()).setup()

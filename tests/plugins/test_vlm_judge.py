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

from gyremedia.config import RewardSettings, Selected
from gyremedia.options import validate
from gyremedia.rollout import Media
from gyremedia.scoring import RewardError, Scorer
from gyremedia_rewards.vlm_judge import PRESETS, JudgeReplyError, VlmJudge, VlmJudgeOptions


@pytest.fixture(scope="module")
def server():
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("judge_server.py"))], stdout=subprocess.PIPE, text=True
    )
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
    scores = judge(server, max_retries=1, request_timeout=0.5)(
        grey(0.5, 0.5, 0.5), ["garbage reply", "a slow judge", "fine"]
    )["score"]
    assert scores[0].isnan() and scores[1].isnan() and scores[2] == pytest.approx(0.5, abs=0.011)
    assert time.perf_counter() - start < 3  # two timed-out attempts, not the server's 3 s sleeps


def test_failure_policy_decides_what_a_bad_reply_does(server):
    reward = judge(server, max_retries=0)
    prompts = ["fine", "garbage again"]
    for policy in ("fail", "drop"):
        scorer = Scorer(
            [Selected("reward", "vlm_judge", None, RewardSettings(on_failure=policy))], {"vlm_judge": reward}
        )
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
    reward = VlmJudge(
        VlmJudgeOptions(base_url="http://127.0.0.1:9/v1", max_retries=1, backoff=0.01, request_timeout=0.5)
    )
    assert reward(grey(0.5), ["anything"])["score"].isnan().all()


def test_rubric_must_name_the_prompt():
    assert "must contain {prompt}" in validate(VlmJudgeOptions(rubric="Rate this image."))[0]


def test_text_answers_are_judged_as_an_llm_judge(server):
    reward = judge(server)
    scores = reward(Media("text", ["one two three", "a b c d e f g"]), ["count", "letters"])["score"]
    torch.testing.assert_close(scores, torch.tensor([0.3, 0.7]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "url,env,extra,error",
    [
        ("http://127.0.0.1:8000/v1", {}, {}, None),  # a keyless local server stays the default
        ("http://localhost:8000/v1", {"OPENAI_API_KEY": "k"}, {}, None),
        ("https://judge.example.com/v1", {}, {}, None),  # a missing key is the run's problem (below), not the config's
        ("https://judge.example.com/v1", {"OPENAI_API_KEY": "k"}, {}, None),
        (
            "http://10.1.2.3:8000/v1",
            {"OPENAI_API_KEY": "k"},
            {},
            "base_url='http://10.1.2.3:8000/v1': http://10.1.2.3:8000/v1 would send the key in OPENAI_API_KEY unencrypted to "
            "another machine: use https://, or set allow_insecure_key: true",
        ),
        ("http://10.1.2.3:8000/v1", {"OPENAI_API_KEY": "k"}, {"allow_insecure_key": True}, None),
        ("http://judge-node:8000/v1", {}, {"api_key_env": ""}, None),  # a server elsewhere that takes no key
    ],
)
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
    assert seen == [
        ("127.0.0.1", "/v1/redirect-away", "Bearer secret"),
        ("127.0.0.2", "/v1/chat/completions", None),
        ("127.0.0.1", "/v1/redirect-here", "Bearer secret"),
        ("127.0.0.1", "/v1/chat/completions", "Bearer secret"),
    ]


def refuse_builds(monkeypatch, when: str) -> None:
    """Any component built from here on fails the test (``when`` says what should have stopped the run first)."""
    from gyremedia.plugins import PluginManager

    def refuse(*args, **kwargs):
        raise AssertionError(f"a component was built {when}")

    monkeypatch.setattr(PluginManager, "build", refuse)


def test_a_run_with_a_remote_judge_and_no_key_stops_before_any_model_loads(make_config, monkeypatch):
    """Checked when training starts (gyremedia_configure), not with the options: `gyremedia export` and `config` of
    such a run need no key."""
    from gyremedia.config import ConfigError
    from gyremedia.plugins import PluginManager
    from gyremedia.trainer import Trainer

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = make_config("rewards=[{name: vlm_judge, base_url: 'https://judge.example.com/v1'}]")

    refuse_builds(monkeypatch, "before the key was checked")
    with pytest.raises(ConfigError) as info:
        Trainer(config, PluginManager()).setup()
    assert str(info.value) == (
        "rewards.0.api_key_env='OPENAI_API_KEY': OPENAI_API_KEY is not set, and base_url=https://judge.example.com/v1 "
        "is not on this machine: export OPENAI_API_KEY=<key> before the run, or set api_key_env to '' for a server "
        "that takes no key"
    )
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    with pytest.raises(AssertionError, match="a component was built"):  # with the key, setup goes on to build
        Trainer(config, PluginManager()).setup()


# UnifiedReward's pointwise image-generation question, as its authors ask the Qwen2.5-VL checkpoints
# (CodeGoat24/UnifiedReward, inference_qwen/image_generation/qwen_point_score_image_generation.py), and as
# Flow-GRPO asks UnifiedReward-7b-v1.5 (yifan123/flow_grpo, flow_grpo/rewards.py): spelled out again here, so an
# edit to the preset's text shows.
UNIFIED_REWARD_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the accuracy "
    "of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, color "
    "accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image using the "
    "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and assign a "
    "score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [a cat on a mat]"
)
FLOW_GRPO_QUESTION = (
    "<image>\n"
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the accuracy "
    "of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, color "
    "accuracy, and overall aesthetic appeal.\n"
    "Based on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [a cat on a mat]"
)


def received(server: str) -> dict:
    with urllib.request.urlopen(server + "/received") as response:
        return json.loads(response.read())


def test_without_a_preset_the_judge_is_the_generic_one_it_was():
    options = VlmJudgeOptions()
    assert (options.preset, options.model, options.score_pattern, options.max_score, options.max_tokens) == (
        "none",
        "Qwen/Qwen2.5-VL-7B-Instruct",
        r"-?\d+(?:\.\d+)?",
        10.0,
        16,
    )
    assert options.rubric.startswith('Does this image match the description: "{prompt}"?')
    assert options.text_rubric.startswith("Here is a request and an answer to it.")


@pytest.mark.parametrize(
    "preset,model,question",
    [
        ("unified_reward", "CodeGoat24/UnifiedReward-qwen-7b", UNIFIED_REWARD_QUESTION),
        ("unified_reward_flow_grpo", "CodeGoat24/UnifiedReward-7b-v1.5", FLOW_GRPO_QUESTION),
    ],
)
def test_a_unified_reward_preset_asks_its_question_beside_the_image_and_reads_the_final_score(preset, model, question):
    options = VlmJudgeOptions(preset=preset)
    assert (options.model, options.max_score, options.max_tokens, options.text_rubric) == (model, 5.0, 512, None)
    assert validate(options) == []
    reward = VlmJudge(options)
    content = reward.message("a cat on a mat", grey(0.5).data[0])
    assert [part["type"] for part in content] == ["image_url", "text"]  # the image first, as UnifiedReward's scripts
    assert content[1]["text"] == question
    # the elements it checked come first, each with a number: the score is the one after "Final Score:"
    assert reward.parse("cat (object): 1\nmat (object): 0\nFinal Score: 3.5") == pytest.approx(3.5 / 5)
    assert reward.parse("Final Score:4") == pytest.approx(0.8)
    for unreadable in ("cat (object): 1\nmat (object): 1", "Final Score: 0.5", "Final Score: seven"):
        with pytest.raises(JudgeReplyError, match="no score"):
            reward.parse(unreadable)


def test_a_unified_reward_judge_scores_over_http_and_a_reply_without_a_final_score_is_nan(server):
    reward = judge(server, preset="unified_reward", max_retries=1)  # model: the name this server serves, which wins
    assert reward.options.model == "test-judge" and reward.options.max_score == 5.0
    scores = reward(grey(0.7, 0.3, 0.5), ["a grey square", "a dark square", "a garbage square"])["score"]
    # the server answers "square (object): 1\nFinal Score: 3.5" for 0.7: read as 3.5 / 5, not the element's 1
    torch.testing.assert_close(scores[:2], torch.tensor([0.7, 0.3]), atol=0.011, rtol=0)
    assert scores[2].isnan()  # Flow-GRPO would score it 0; here it is retried, then left to on_failure
    sent = received(server)["a grey square"]
    assert [part["type"] for part in sent] == ["image_url", "text"]
    assert sent[1]["text"] == UNIFIED_REWARD_QUESTION.replace("a cat on a mat", "a grey square")


def test_keys_the_yaml_sets_win_over_the_preset():
    options = VlmJudgeOptions(
        preset="unified_reward", model="UnifiedReward", max_tokens=1024, score_pattern=r"Final Score:\s*(\d+(?:\.\d+)?)"
    )
    assert (options.model, options.max_tokens, options.score_pattern) == (
        "UnifiedReward",
        1024,
        r"Final Score:\s*(\d+(?:\.\d+)?)",
    )
    assert options.rubric == PRESETS["unified_reward"].rubric and options.max_score == 5.0


def test_a_preset_refuses_the_generic_question_left_over_from_a_saved_config():
    generic = VlmJudgeOptions()
    errors = validate(VlmJudgeOptions(preset="unified_reward", rubric=generic.rubric))
    assert len(errors) == 1 and errors[0].startswith("rubric='Does this image match")
    assert errors[0].endswith(
        ": is preset none's rubric, which preset 'unified_reward' replaces with its own: leave "
        "rubric out (a config saved before the preset was chosen holds it), or set preset: none"
    )
    assert validate(VlmJudgeOptions(preset="unified_reward", max_score=10.0))[0].startswith(
        "max_score=10.0: is preset none's max_score"
    )


def test_the_resolved_config_holds_the_presets_values_and_resolves_to_itself(make_config, tmp_path):
    from gyremedia.config import load_config, resolve_config
    from gyremedia.plugins import PluginManager

    config = make_config("rewards=[{name: vlm_judge, preset: unified_reward, model: UnifiedReward}]")
    options = config.rewards[0].options
    assert options.model == "UnifiedReward"
    assert (options.rubric, options.max_score) == (PRESETS["unified_reward"].rubric, 5.0)
    saved = tmp_path / "resolved.yaml"
    saved.write_text(config.to_yaml())
    again = resolve_config(load_config(saved, []), PluginManager())
    assert again.rewards[0].options == options and again.to_yaml() == config.to_yaml()


def test_an_unknown_preset_names_the_choices(make_config):
    from gyremedia.config import ConfigError

    with pytest.raises(
        ConfigError,
        match="rewards.0.preset='unifiedreward': expected one of none, unified_reward, unified_reward_flow_grpo",
    ):
        make_config("rewards=[{name: vlm_judge, preset: unifiedreward}]")


def test_a_unified_reward_preset_refuses_text_before_any_model_loads(make_llm_config, monkeypatch):
    from gyremedia.config import ConfigError
    from gyremedia.plugins import PluginManager
    from gyremedia.trainer import Trainer

    with pytest.raises(RuntimeError, match="preset 'unified_reward' judges images, not text"):
        VlmJudge(VlmJudgeOptions(preset="unified_reward"))(Media("text", ["4"]), ["2+2="])
    config = make_llm_config("rewards=[{name: vlm_judge, preset: unified_reward}]")

    refuse_builds(monkeypatch, "before the preset was checked")
    with pytest.raises(ConfigError) as info:
        Trainer(config, PluginManager()).setup()
    assert str(info.value) == (
        "rewards.0.preset='unified_reward': judges images, but backbone 'causal_lm' makes text: "
        "use preset: none (its text_rubric), or set text_rubric, score_pattern and max_score"
    )

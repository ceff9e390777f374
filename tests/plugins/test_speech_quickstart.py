"""`gyremedia train speech_quickstart` end to end: online RL makes the tiny enhancer better on unseen
sentences and voices by every metric it is rewarded with, without losing fidelity to the clean speech.

Slow and run in CI, with one torch thread (eSpeak NG's clock-seeded voices make no two runs bit-identical anyway:
docs/benchmarks.md). It trains from the shipped `assets/speech16` with a fixed seed; the run itself scores 128
fixed-seed enhancements of the 64 held-out utterances before and after and writes every metric's paired change
(`heldout_changes.json`, the figures `gyremedia eval RUN` reports). Asserted, as the speech issue asks: PESQ, ESTOI
and DNSMOS OVRL each rise with the paired 95% interval above zero, and SI-SDR (a gold metric, never trained on) does
not fall: its interval's upper end is above zero. docs/benchmarks.md has the figures over 3 seeds.
"""

import json

import pytest

from cli_runs import gyremedia, with_threads

REWARDED = ("pesq", "estoi", "dnsmos")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_speech_quickstart_raises_every_heldout_metric(tmp_path):
    run = tmp_path / "speech"
    gyremedia("train", "speech_quickstart", f"run.output_dir={run}", timeout=1200, env=with_threads(1))
    for made in (
        "samples/compare.png",
        "samples/before/00.wav",
        "samples/after/00.wav",
        "reward_curve.png",
        "pipeline/unet/config.json",
    ):
        assert (run / made).is_file(), made

    changes = json.loads((run / "heldout_changes.json").read_text())
    print(json.dumps(changes, indent=1))
    for metric in REWARDED:
        assert changes[metric]["samples"] == 128
        assert changes[metric]["ci95_low"] > 0, (metric, changes[metric])
    assert changes["gold/si_sdr"]["ci95_high"] > 0, changes["gold/si_sdr"]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["monitor/hacking"] == 0.0

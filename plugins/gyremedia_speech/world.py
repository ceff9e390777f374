"""NoisySpeech: noisy utterances made offline from eSpeak NG speech and synthetic noise, 16 kHz mono.

A prompt names everything needed to rebuild its utterance, so the backbone (the noisy input) and the
intrusive rewards (the clean reference) recompute it from the prompt alone, as the world-model rewards
recompute their truth::

    "sentence 7, voice en-us+f3, rate 170, pitch 50: babble at 3 dB, noise 17"

The clean signal is the sentence spoken by the voice, resampled to 16 kHz, trimmed of silence, centred
in a clip of :data:`CLIP_SAMPLES` samples and scaled to a fixed loudness. The noise (stationary white,
pink or mains hum with harmonics; non-stationary babble of three other utterances of the same split, or
bursts) is drawn from ``noise`` and scaled to the SNR. Train and held-out prompts differ in sentence and
in voice (:func:`split_prompts`). Everything is deterministic; a clip takes about 10 ms to make.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SAMPLE_RATE = 16000
CLIP_SAMPLES = 20320  # 1.27 s: 128 STFT frames at a 10 ms hop (gyremedia_speech.stft)
CLEAN_RMS = 0.05  # about -26 dBFS, so mixtures at -5 dB stay within [-1, 1]
NOISE_KINDS = ("white", "pink", "hum", "babble", "bursts")
SNR_RANGE = (-5, 15)  # dB
RATES = (140, 160, 180, 200)  # words per minute
PITCHES = (30, 45, 60, 75)

#: Our own sentence list: short, everyday, every phoneme class; the last 12 are held out.
SENTENCES = (
    "open the red door",
    "the dog runs home",
    "we bake fresh bread",
    "call me at noon",
    "the sun is warm",
    "pass the salt please",
    "birds sing at dawn",
    "my car is blue",
    "read the next page",
    "she plays chess",
    "turn off the light",
    "the lake is cold",
    "he fixed the chair",
    "rain falls all day",
    "buy six green apples",
    "the train was late",
    "wash your hands now",
    "a fox jumped high",
    "keep the change",
    "they walked to school",
    "put on your coat",
    "the milk is sour",
    "we sat by the fire",
    "her voice is soft",
    "the clock struck nine",
    "send me a letter",
    "the cat sleeps inside",
    "bring the map along",
    "this soup tastes good",
    "close the window",
    "the kids laughed loudly",
    "paint the fence white",
    "a bee flew past",
    "lock the gate tonight",
    "the river runs fast",
    "pick up the phone",
    # held out
    "the bus stops here",
    "water the plants",
    "his shoes are wet",
    "the song ended well",
    "find the lost key",
    "we need more chairs",
    "the boat sailed away",
    "cut the paper twice",
    "the room smells nice",
    "wait for the signal",
    "the horse ate hay",
    "move the box over",
)
HELDOUT_SENTENCES = 12
TRAIN_VOICES = ("en-us+m3", "en-us+f3", "en+m1", "en+f2", "en-us+m7", "en+f4")
HELDOUT_VOICES = ("en-us+m5", "en+f5")

_PROMPT = re.compile(r"^sentence (\d+), voice (\S+), rate (\d+), pitch (\d+): (\w+) at (-?\d+) dB, noise (\d+)$")


@dataclass(frozen=True)
class Utterance:
    """One noisy utterance: who says which sentence how, and the noise over it."""

    sentence: int
    voice: str
    rate: int
    pitch: int
    noise_kind: str
    snr_db: int
    noise_seed: int

    @property
    def prompt(self) -> str:
        return (
            f"sentence {self.sentence}, voice {self.voice}, rate {self.rate}, pitch {self.pitch}: "
            f"{self.noise_kind} at {self.snr_db} dB, noise {self.noise_seed}"
        )

    @property
    def heldout(self) -> bool:
        return self.sentence >= len(SENTENCES) - HELDOUT_SENTENCES

    def clean(self) -> np.ndarray:
        """The clean clip, ``[CLIP_SAMPLES]`` float32."""
        return _clean(self.sentence, self.voice, self.rate, self.pitch).copy()

    def noise(self) -> np.ndarray:
        """The noise at the utterance's SNR relative to :meth:`clean`."""
        rng = np.random.default_rng(self.noise_seed)
        noise = _NOISES[self.noise_kind](rng, self)
        noise = noise / max(float(np.sqrt(np.mean(noise**2))), 1e-8)
        return (noise * CLEAN_RMS * 10 ** (-self.snr_db / 20)).astype(np.float32)

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        """``(noisy, clean)``, both scaled by the same factor if the mixture would clip."""
        clean = self.clean()
        noisy = clean + self.noise()
        scale = min(1.0, 0.99 / float(np.abs(noisy).max()))
        return (noisy * scale).astype(np.float32), (clean * scale).astype(np.float32)


def parse_prompt(text: str) -> Utterance:
    """Parse a NoisySpeech prompt; raises ``ValueError`` showing the format for anything else."""
    m = _PROMPT.match(" ".join(text.split()))
    if not m or m.group(5) not in NOISE_KINDS or int(m.group(1)) >= len(SENTENCES):
        raise ValueError(
            f"{text!r} is not a NoisySpeech prompt: expected 'sentence N, voice VOICE, rate R, pitch P: "
            f"KIND at S dB, noise SEED' with N < {len(SENTENCES)} and KIND one of {', '.join(NOISE_KINDS)}"
        )
    return Utterance(
        int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5), int(m.group(6)), int(m.group(7))
    )


def split_prompts(train: int = 512, heldout: int = 64, seed: int = 0) -> tuple[list[str], list[str]]:
    """Train and held-out prompts: held-out ones use sentences and voices no train prompt uses."""
    rng = np.random.default_rng(seed)

    def draw(count: int, sentences: range, voices: tuple[str, ...], first_seed: int) -> list[str]:
        return [
            Utterance(
                int(rng.choice(sentences)),
                str(rng.choice(voices)),
                int(rng.choice(RATES)),
                int(rng.choice(PITCHES)),
                str(rng.choice(NOISE_KINDS)),
                int(rng.integers(SNR_RANGE[0], SNR_RANGE[1] + 1)),
                first_seed + i,
            ).prompt
            for i in range(count)
        ]

    boundary = len(SENTENCES) - HELDOUT_SENTENCES
    return (
        draw(train, range(boundary), TRAIN_VOICES, 0),
        draw(heldout, range(boundary, len(SENTENCES)), HELDOUT_VOICES, 1_000_000),
    )


# --------------------------------------------------------------------------- clean speech


@lru_cache(maxsize=4096)
def _clean(sentence: int, voice: str, rate: int, pitch: int) -> np.ndarray:
    from scipy.signal import resample_poly

    from gyremedia_speech.espeak import sample_rate, synthesize

    speech = synthesize(SENTENCES[sentence], voice=voice, rate=rate, pitch=pitch)
    speech = resample_poly(speech, SAMPLE_RATE, sample_rate()).astype(np.float32)
    loud = np.flatnonzero(np.abs(speech) > 0.02 * np.abs(speech).max())
    speech = speech[loud[0] : loud[-1] + 1][: CLIP_SAMPLES - SAMPLE_RATE // 20]  # trimmed, 25 ms margins at least
    clip = np.zeros(CLIP_SAMPLES, dtype=np.float32)
    start = (CLIP_SAMPLES - len(speech)) // 2
    clip[start : start + len(speech)] = speech
    return clip * (CLEAN_RMS / float(np.sqrt(np.mean(clip**2))))


# --------------------------------------------------------------------------- noise


def _white(rng: np.random.Generator, utterance: Utterance) -> np.ndarray:
    return rng.standard_normal(CLIP_SAMPLES)


def _pink(rng: np.random.Generator, utterance: Utterance) -> np.ndarray:
    """1/f power: white noise shaped by 1/sqrt(f) in the frequency domain."""
    spectrum = np.fft.rfft(rng.standard_normal(CLIP_SAMPLES))
    frequencies = np.fft.rfftfreq(CLIP_SAMPLES, 1 / SAMPLE_RATE)
    spectrum /= np.sqrt(np.maximum(frequencies, 20.0))
    return np.fft.irfft(spectrum, CLIP_SAMPLES)


def _hum(rng: np.random.Generator, utterance: Utterance) -> np.ndarray:
    """Mains hum at 50 or 60 Hz with decaying odd and even harmonics and a little hiss."""
    t = np.arange(CLIP_SAMPLES) / SAMPLE_RATE
    base = rng.choice([50.0, 60.0])
    hum = sum(
        rng.uniform(0.3, 1.0) / k * np.sin(2 * np.pi * base * k * t + rng.uniform(0, 2 * np.pi)) for k in range(1, 9)
    )
    return hum + 0.05 * rng.standard_normal(CLIP_SAMPLES)


def _babble(rng: np.random.Generator, utterance: Utterance) -> np.ndarray:
    """Three other utterances of the same split (sentence and voice), each circularly shifted."""
    boundary = len(SENTENCES) - HELDOUT_SENTENCES
    sentences = range(boundary, len(SENTENCES)) if utterance.heldout else range(boundary)
    voices = HELDOUT_VOICES if utterance.heldout else TRAIN_VOICES
    others = [s for s in sentences if s != utterance.sentence]
    talkers = [
        np.roll(
            _clean(int(rng.choice(others)), str(rng.choice(voices)), int(rng.choice(RATES)), int(rng.choice(PITCHES))),
            int(rng.integers(CLIP_SAMPLES)),
        )
        for _ in range(3)
    ]
    return np.sum(talkers, axis=0)


def _bursts(rng: np.random.Generator, utterance: Utterance) -> np.ndarray:
    """Two to five bursts of band-limited noise, 30-150 ms each, with fast attack and decay."""
    noise = np.zeros(CLIP_SAMPLES)
    for _ in range(int(rng.integers(2, 6))):
        length = int(rng.integers(SAMPLE_RATE * 3 // 100, SAMPLE_RATE * 15 // 100))
        start = int(rng.integers(0, CLIP_SAMPLES - length))
        burst = np.convolve(rng.standard_normal(length), np.ones(int(rng.integers(1, 8))), mode="same")
        noise[start : start + length] += burst * np.hanning(length) * rng.uniform(0.5, 1.0)
    return noise + 0.01 * rng.standard_normal(CLIP_SAMPLES)


_NOISES = {"white": _white, "pink": _pink, "hum": _hum, "babble": _babble, "bursts": _bursts}

"""Speech from eSpeak NG through ctypes on the library and voice data that the ``espeakng-loader`` wheel
ships (so no system package is needed): :func:`synthesize` returns 16-bit PCM at eSpeak's own rate."""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
ESPEAK_CHARS_AUTO = 0
RATE, VOLUME, PITCH, RANGE = 1, 2, 3, 4  # espeak_PARAMETER
SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_lock = threading.Lock()  # the library keeps one global synthesizer


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL, int]:
    """Load and initialise libespeak-ng once; returns it and its output sample rate."""
    try:
        import espeakng_loader
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ImportError("speech synthesis needs eSpeak NG: pip install espeakng-loader") from error
    library = ctypes.CDLL(espeakng_loader.get_library_path())
    library.espeak_Initialize.restype = ctypes.c_int
    library.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    library.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    library.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    library.espeak_Synth.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    library.espeak_SetSynthCallback.argtypes = [SYNTH_CALLBACK]
    rate = library.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
    if rate <= 0:
        raise RuntimeError(f"eSpeak NG failed to initialise (returned {rate})")
    return library, rate


def sample_rate() -> int:
    """eSpeak NG's output rate in Hz (22050)."""
    return _library()[1]


def synthesize(text: str, *, voice: str, rate: int, pitch: int) -> np.ndarray:
    """``text`` spoken by ``voice`` (e.g. ``"en-us+f3"``) at ``rate`` words per minute and ``pitch`` (0-99):
    float32 samples in [-1, 1] at :func:`sample_rate`. Not bit-for-bit a function of the arguments: the library's
    random generator is seeded from the clock and its state carries from one utterance to the next
    (docs/benchmarks.md, "A reward in a process of its own")."""
    library, _ = _library()
    chunks: list[np.ndarray] = []

    def collect(wav, count, events):
        if count > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    callback = SYNTH_CALLBACK(collect)
    encoded = text.encode() + b"\0"
    with _lock:
        library.espeak_SetSynthCallback(callback)
        if library.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}")
        library.espeak_SetParameter(RATE, rate, 0)
        library.espeak_SetParameter(PITCH, pitch, 0)
        status = library.espeak_Synth(encoded, len(encoded), 0, POS_CHARACTER, 0, ESPEAK_CHARS_AUTO, None, None)
    if status != 0 or not chunks:
        raise RuntimeError(f"eSpeak NG could not speak {text!r} (status {status})")
    return np.concatenate(chunks).astype(np.float32) / 32768

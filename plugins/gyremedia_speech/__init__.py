"""NoisySpeech: offline noisy utterances (eSpeak NG speech, synthetic noise), a flow-matching speech enhancer
(``speech_enhancement``) and speech quality rewards: ``dnsmos`` (non-intrusive), ``pesq``, ``estoi`` and
``si_sdr`` (against the clean reference). ``python -m gyremedia_speech.pretrain`` makes the shipped model."""

from gyremedia import hookimpl
from gyremedia_speech.backbone import SpeechEnhancementBackbone, SpeechEnhancementOptions
from gyremedia_speech.rewards import DNSMOSOptions, DNSMOSReward, ESTOIReward, PESQReward, SISDRReward


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "speech_enhancement",
        SpeechEnhancementBackbone,
        options=SpeechEnhancementOptions,
        description="flow-matching speech enhancement in the complex STFT domain (diffusers UNet2DModel)",
    )


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "dnsmos",
        DNSMOSReward,
        options=DNSMOSOptions,
        description="DNSMOS P.835: non-intrusive MOS of speech (1-5), ONNX models of the speechmos package",
    )
    register("pesq", PESQReward, description="wide-band PESQ (P.862.2) against the clean reference")
    register("estoi", ESTOIReward, description="extended STOI intelligibility against the clean reference")
    register("si_sdr", SISDRReward, description="scale-invariant SDR in dB against the clean reference")


@hookimpl
def gyremedia_on_eval(state, media, metrics):
    """A speech-enhancement run's last evaluation also writes samples/compare.png and the noisy and clean clips."""
    if isinstance(state.backbone, SpeechEnhancementBackbone):
        from gyremedia_speech.samples import comparison_after_training

        comparison_after_training(state, media)

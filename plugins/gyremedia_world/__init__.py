"""GridWalk: a 2-D world with discrete actions, an action-conditioned video world model of it
(``video_world``), and verifiable rewards for generated clips: ``inverse_dynamics`` (RLIR) and
``world_fidelity`` (RLVR-World). ``python -m gyremedia_world.pretrain`` makes the shipped models. Every run is
watched at every clip index of the model's own rollouts (:mod:`gyremedia_world.monitor`)."""

from gyremedia import hookimpl
from gyremedia_world.backbone import VideoWorldBackbone, VideoWorldOptions
from gyremedia_world.monitor import watch_every_clip
from gyremedia_world.rewards import FidelityOptions, FidelityReward, InverseDynamicsOptions, InverseDynamicsReward


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "video_world",
        VideoWorldBackbone,
        options=VideoWorldOptions,
        description="action-conditioned video flow world model (diffusers Wan transformer), clip by clip",
    )


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "inverse_dynamics",
        InverseDynamicsReward,
        options=InverseDynamicsOptions,
        description="RLIR: share of commanded actions an inverse dynamics model recovers from the clip",
    )
    register(
        "world_fidelity",
        FidelityReward,
        options=FidelityOptions,
        description="RLVR-World: PSNR / SSIM of the clip against the environment's true frames",
    )


@hookimpl
def gyremedia_setup(state, context):
    watch_every_clip(state)

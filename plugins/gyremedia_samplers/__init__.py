"""First-party samplers (transition kernels), registered through the ``gyremedia`` entry point."""

from gyremedia import hookimpl
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.dance_sde import DanceSDEOptions, DanceSDESampler
from gyremedia_samplers.ddim import DDIMEtaOptions, DDIMEtaSampler
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.ode import EulerODESampler, HeunODESampler
from gyremedia_samplers.window import WindowOptions, WindowSampler


@hookimpl
def gyremedia_register_samplers(register):
    register(
        "flow_sde",
        FlowSDESampler,
        options=FlowSDEOptions,
        description="Flow-GRPO's SDE step with the flow ODE's marginals; Gaussian log-prob per step",
    )
    register(
        "cps",
        CPSSampler,
        options=CPSOptions,
        description="coefficients-preserving sampling: noise injected without leaving the flow's path",
    )
    register(
        "dance_sde",
        DanceSDESampler,
        options=DanceSDEOptions,
        description="DanceGRPO's score-based SDE step; Gaussian log-prob per step",
    )
    register(
        "window",
        WindowSampler,
        options=WindowOptions,
        description="MixGRPO: SDE steps inside a moving window, ODE outside; only the window is trained",
    )
    register(
        "ode",
        EulerODESampler,
        description="deterministic Euler step of the flow ODE (evaluation, forward-process objectives)",
    )
    register(
        "ddim_eta",
        DDIMEtaSampler,
        options=DDIMEtaOptions,
        description="DDPO's DDIM-eta step for variance-preserving diffusion backbones (v predictions); Gaussian log-prob per step",
    )
    register(
        "heun",
        HeunODESampler,
        description="Heun's second-order ODE step (2 model evaluations per step); forward-process objectives",
    )

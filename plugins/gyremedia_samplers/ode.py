"""The deterministic Euler step of the flow ODE: what a diffusers pipeline's Euler scheduler does."""

from gyremedia.interfaces import Transition


class EulerODESampler:
    """``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v``; no noise, so no log-probability."""

    has_log_prob = False

    def __init__(self, context=None) -> None:
        pass

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        dt = (sigmas[index + 1] - sigmas[index]).to(x.dtype)
        mean = x + dt * model_output.to(x.dtype)
        return Transition(next_state=mean if next_state is None else next_state, mean=mean)

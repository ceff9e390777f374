"""Deterministic steps of the flow ODE: Euler (what a diffusers pipeline's Euler scheduler does) and Heun."""

from gyremedia.interfaces import Transition


class EulerODESampler:
    """``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v``; no noise, so no log-probability."""

    has_log_prob = False
    prediction = "velocity"

    def __init__(self, context=None) -> None:
        pass

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        dt = (sigmas[index + 1] - sigmas[index]).to(x.dtype)
        mean = x + dt * model_output.to(x.dtype)
        return Transition(next_state=mean if next_state is None else next_state, mean=mean)


class HeunODESampler:
    """Heun's second-order step: an Euler predictor, then the mean of the velocities at both ends.

        x' = x + dt v(x, sigma_i)        x_{i+1} = x + dt (v(x, sigma_i) + v(x', sigma_{i+1})) / 2

    Its error per step is O(dt^3) against Euler's O(dt^2), so half the steps reach the same accuracy
    for about the same model evaluations; the last step (to sigma = 0) is Euler, as in EDM. For
    forward-process objectives, which only need clean samples and no log-probs.
    """

    has_log_prob = False
    prediction = "velocity"
    needs_predict = True  # re-evaluates the model within a step: the rollout passes ``predict``

    def __init__(self, context=None) -> None:
        pass

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None, predict=None) -> Transition:
        sigma_next = sigmas[index + 1]
        dt = (sigma_next - sigmas[index]).to(x.dtype)
        v = model_output.to(x.dtype)
        euler = x + dt * v
        if float(sigma_next) == 0 or next_state is not None:
            return Transition(next_state=euler if next_state is None else next_state, mean=euler)
        if predict is None:
            raise ValueError("heun evaluates the model twice per step: call step(..., predict=...)")
        mean = x + dt * (v + predict(euler, sigma_next).to(x.dtype)) / 2
        return Transition(next_state=mean, mean=mean)

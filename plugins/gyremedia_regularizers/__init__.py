"""First-party regularizers, registered through the ``gyremedia`` entry point like any third party's."""

from gyremedia import hookimpl
from gyremedia_regularizers.token import TokenKL
from gyremedia_regularizers.velocity import (
    GaussianKL,
    GaussianKLOptions,
    NormHingeOptions,
    VelocityKL,
    VelocityKLOptions,
    VelocityNormHinge,
)


@hookimpl
def gyremedia_register_regularizers(register):
    register(
        "velocity_norm_hinge",
        VelocityNormHinge,
        options=NormHingeOptions,
        description="penalise ||v|| above the reference's ||v_ref|| (per sample, per step); logs the inflation",
    )
    register(
        "velocity_kl",
        VelocityKL,
        options=VelocityKLOptions,
        description="velocity-space KL to the reference, ||v - v_ref||^2 (CFG-guided reference: CRD); adaptive",
    )
    register("token_kl", TokenKL, description="k3 KL of a token policy to its reference, aggregated like the objective")
    register(
        "gaussian_kl",
        GaussianKL,
        options=GaussianKLOptions,
        description="exact KL between Gaussian SDE transitions and the reference's (Flow-GRPO); adaptive",
    )

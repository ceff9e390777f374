"""ShapesBench: a compositional text-to-image world, its deterministic verifier reward, and the
script that pretrains the tiny quickstart model on it (``python -m gyremedia_shapes.pretrain``)."""

from gyremedia import hookimpl
from gyremedia_shapes.surrogate import ShapesSurrogateReward, SurrogateOptions
from gyremedia_shapes.verifier_reward import ShapesVerifierOptions, ShapesVerifierReward


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "shapes_verifier",
        ShapesVerifierReward,
        options=ShapesVerifierOptions,
        description="ShapesBench verifier: object, colour, count and position of shapes vs the prompt",
    )
    register(
        "shapes_surrogate",
        ShapesSurrogateReward,
        options=SurrogateOptions,
        description="a small network predicting the ShapesBench verifier's score from pixels; differentiable "
        "(spatial credit's gradient map)",
    )

"""Addition: a tiny verifiable text task for RL on token policies. ``task`` makes the problems
(``"47+385="`` -> ``"432"``), their hash-based train / held-out split and the exact-match check;
``pretrain`` (``python -m gyremedia_text.pretrain``) trains the character tokenizer and the tiny stock
Llama causal LM of ``assets/addition``, stopped early so that RL has room to raise its accuracy; ``masked_pretrain``
(``python -m gyremedia_text.masked_pretrain``) the masked-diffusion BERT of ``assets/addition_masked``."""

from gyremedia import hookimpl
from gyremedia_text.reward import AdditionVerifier, AdditionVerifierOptions


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "addition_verifier",
        AdditionVerifier,
        options=AdditionVerifierOptions,
        description="text: exact match of the completion's answer with the sum the prompt asks for",
    )

"""The training plumbing every diffusers-transformer backbone shares: full or LoRA training, the frozen
reference policy, checkpointed weights, and noise levels from the backbone's flow-matching scheduler."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gyremedia.options import OptionError, option


@dataclass
class LoraOptions:
    enabled: bool = option(False, help="train LoRA adapters instead of the full model")
    rank: int = option(8, ge=1, help="adapter rank")
    alpha: float = option(16.0, gt=0, help="adapter scale numerator (the scale is alpha / rank)")
    target_modules: list[str] = option(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
                                       help="module names the adapters wrap")

    def validate(self) -> None:
        if self.enabled and not self.target_modules:
            raise OptionError("target_modules", "name at least one module for the adapters")


class TransformerPolicy:
    """Base of a backbone whose policy is one diffusers transformer (``self.transformer``).

    A subclass sets ``transformer`` and ``scheduler``, then calls :meth:`_prepare_training`; it runs
    the model through :meth:`_forward`, which picks the training wrapper, the plain module or the
    reference. Extra trainable submodules (``_extra_trainable``) checkpoint beside LoRA adapters.
    """

    transformer: torch.nn.Module
    scheduler: object
    device: torch.device

    def _prepare_training(self, lora: LoraOptions, gradient_checkpointing: bool) -> None:
        """Add LoRA adapters (fp32, whatever the base weights are) and gradient checkpointing if asked."""
        self.lora_enabled = lora.enabled
        self._reference_transformer: torch.nn.Module | None = None
        if lora.enabled:
            from peft import LoraConfig

            self.transformer.requires_grad_(False)
            self.transformer.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                    target_modules=list(lora.target_modules),
                                                    init_lora_weights="gaussian"))
            for p in self.transformer.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        if gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()
        self._training_module: torch.nn.Module = self.transformer

    def _extra_trainable(self) -> dict[str, torch.nn.Module]:
        """Trainable submodules of the transformer that LoRA does not cover (checkpointed by name)."""
        return {}

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

    def set_training_module(self, module: torch.nn.Module) -> None:
        self._training_module = module

    def enable_reference(self) -> None:
        """Keep the frozen base policy for KL terms: the adapters switched off under LoRA, else a copy."""
        if not self.lora_enabled and self._reference_transformer is None:
            self._reference_transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        if self.lora_enabled:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.transformer)
            for name, module in self._extra_trainable().items():
                state.update({f"{name}.{k}": v for k, v in module.state_dict().items()})
            return {k: v.detach().clone() for k, v in state.items()}
        return {k: v.detach().clone() for k, v in self.transformer.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not self.lora_enabled:
            self.transformer.load_state_dict(state)
            return
        from peft import set_peft_model_state_dict

        for name, module in self._extra_trainable().items():
            prefix = f"{name}."
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
        result = set_peft_model_state_dict(self.transformer, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"checkpoint has adapter weights this model lacks: {result.unexpected_keys[:5]}")

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's ``num_steps + 1`` noise levels, from 1 down to 0."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps, device=self.device)
        return scheduler.sigmas.float()

    def _forward(self, reference: bool, **inputs) -> torch.Tensor:
        """The transformer's output for ``inputs``: the training wrapper when gradients are on, the
        frozen reference (no gradients) when ``reference``."""
        if not reference:
            module = self._training_module if torch.is_grad_enabled() else self.transformer
            return module(**inputs, return_dict=False)[0]
        with torch.no_grad():
            if self._reference_transformer is not None:
                return self._reference_transformer(**inputs, return_dict=False)[0]
            if not self.lora_enabled:
                raise RuntimeError("the reference policy was not kept: call enable_reference() before training")
            self.transformer.disable_adapters()
            try:
                return self.transformer(**inputs, return_dict=False)[0]
            finally:
                self.transformer.enable_adapters()

    def _merged_transformer(self) -> torch.nn.Module:
        """The transformer with LoRA adapters folded in (a copy), or itself without LoRA."""
        if not self.lora_enabled:
            return self.transformer
        merged = copy.deepcopy(self.transformer)
        merged.fuse_lora()
        merged.unload_lora()  # drops the adapter layers, keeping the fused weights
        return merged

"""The training plumbing every backbone built on one network shares (a diffusers transformer or UNet, or a
transformers language model): full or LoRA training through peft, the frozen reference policy,
checkpointed weights and the adapters merged for export."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gyremedia.options import OptionError, option

# train.mixed_precision: the autocast dtype of every forward (None: the weights' own dtype)
MIXED_PRECISION: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}


@dataclass
class LoraOptions:
    enabled: bool = option(False, help="train LoRA adapters instead of the full model")
    rank: int = option(8, ge=1, help="adapter rank")
    alpha: float = option(16.0, gt=0, help="adapter scale numerator (the scale is alpha / rank)")
    target_modules: list[str] = option(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"], help="module names the adapters wrap"
    )

    def validate(self) -> None:
        if self.enabled and not self.target_modules:
            raise OptionError("target_modules", "name at least one module for the adapters")


class TransformerPolicy:
    """Base of a backbone whose policy is one network (``self.transformer``; a UNet for Stable Diffusion): a
    diffusers model or a transformers one, both of which take peft adapters the same way (``add_adapter``,
    ``disable_adapters``).

    A subclass sets ``transformer``, then calls :meth:`_prepare_training`; it runs the model through
    :meth:`_forward`, which picks the training wrapper, the plain module or the reference. Extra
    trainable submodules (``_extra_trainable``) checkpoint beside LoRA adapters.
    """

    transformer: torch.nn.Module
    device: torch.device
    compilable = True  # capability: compile() below (train.compile)

    def _prepare_training(self, lora: LoraOptions, gradient_checkpointing: bool, mixed_precision: str = "none") -> None:
        """Add LoRA adapters (fp32, whatever the base weights are) and gradient checkpointing if asked.

        ``mixed_precision="bf16"`` computes every forward (rollout, training, reference) under bf16 autocast, so
        they agree bit for bit; the trained weights stay fp32 (master weights) and, under LoRA, the frozen base
        weights become bf16."""
        self.lora_enabled = lora.enabled
        self._reference_transformer: torch.nn.Module | None = None
        self._sharded = False
        self._autocast_dtype = MIXED_PRECISION[mixed_precision]
        if self._autocast_dtype is not None:
            cast_weights(self.transformer, self._autocast_dtype if lora.enabled else torch.float32)
        if lora.enabled:
            from peft import LoraConfig

            self.transformer.requires_grad_(False)
            add_adapters(
                self.transformer,
                LoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    init_lora_weights="gaussian",
                    target_modules=list(lora.target_modules),
                ),
            )
        if gradient_checkpointing:  # diffusers' name, then transformers'
            enable = getattr(self.transformer, "enable_gradient_checkpointing", None)
            (enable or self.transformer.gradient_checkpointing_enable)()
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

    def compile(self) -> None:
        """Compile the network and a frozen reference copy in place (``nn.Module.compile``: the module keeps
        its parameters and names; a deep copy, like an export's merged model, is an eager module)."""
        # The policy and its reference share one forward's code, so they share dynamo's recompile limit (8 by
        # default): rollout, update, reference and evaluation shapes and modes can pass it, and past it dynamo
        # runs eager without a word. Room for them all:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for module in (self.transformer, self._reference_transformer):
            if module is not None:
                # Under bf16 the rollout's graph (no gradients) and the update's fuse differently; keeping eager's
                # casts between fused ops makes both round as eager does, so on-policy ratios stay exactly 1.
                module.compile(options={"emulate_precision_casts": True})

    def shard(self) -> int:
        """Shard the transformer (and a frozen reference copy) over the processes, FSDP2 (see
        :mod:`gyremedia.runtime.sharding`); returns the number of blocks each is sharded by."""
        from gyremedia.runtime import sharding

        if self._extra_trainable():
            raise ValueError(
                f"{', '.join(self._extra_trainable())} cannot be trained sharded yet: use train.sharding=none"
            )
        units = sharding.shard(self.transformer)
        if self._reference_transformer is not None:
            sharding.shard(self._reference_transformer)
        self._sharded = True
        return units

    def unshard(self) -> None:
        """At the end of a sharded run, give the main process a whole transformer to export (a collective:
        every process calls it; the others keep their shards)."""
        from gyremedia.runtime import sharding

        if not self._sharded:
            return
        adapters = self.transformer.peft_config["default"] if self.lora_enabled else None
        whole = sharding.unsharded_copy(
            self.transformer, prepare=(lambda m: add_adapters(m, adapters)) if adapters else None
        )
        if whole is not None:
            self.transformer = self._training_module = whole
            self._sharded = False
            self._transformer_replaced()

    def _transformer_replaced(self) -> None:
        """Called after :meth:`unshard` put a new module in ``self.transformer`` (point containers at it)."""

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the adapters (and extra modules) under LoRA, else every weight. Sharded,
        a collective that gives the whole of it to the main process (the others get an empty dict)."""
        from gyremedia.runtime import sharding

        state = sharding.full_state_dict(self.transformer) if self._sharded else self.transformer.state_dict()
        if self.lora_enabled and state:
            from peft import get_peft_model_state_dict

            adapters = get_peft_model_state_dict(self.transformer, state_dict=state)
            for name in self._extra_trainable():
                adapters.update({k: v for k, v in state.items() if k.startswith(f"{name}.")})
            state = adapters
        return {k: v.detach().clone() for k, v in state.items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`trainable_state_dict` returned (before the transformer is sharded)."""
        if self._sharded:
            raise RuntimeError("load the checkpoint's weights before sharding the transformer")
        if not self.lora_enabled:
            self.transformer.load_state_dict(state)
            return
        from peft import set_peft_model_state_dict

        for name, module in self._extra_trainable().items():
            prefix = f"{name}."
            module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
        result = set_peft_model_state_dict(self.transformer, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"checkpoint has adapter weights this model lacks: {result.unexpected_keys[:5]}")

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the denoised states: fp32 under mixed precision, else the transformer's."""
        return torch.float32 if self._autocast_dtype is not None else self.transformer.dtype

    def _forward(self, reference: bool, **inputs) -> torch.Tensor:
        """The transformer's output for ``inputs``: the training wrapper when gradients are on, the
        frozen reference (no gradients) when ``reference``; under autocast with mixed precision."""
        with self._autocast():
            return self._forward_module(reference, **inputs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to ``train.mixed_precision`` (a no-op without it): wraps every call of the transformer."""
        dtype = self._autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def _forward_module(self, reference: bool, **inputs) -> Any:
        """The module's first output; its whole output object when ``inputs`` ask for ``return_dict=True``."""
        whole = inputs.pop("return_dict", False)
        if not reference:
            module = self._training_module if torch.is_grad_enabled() else self.transformer
            return _first_or_whole(module(**inputs, return_dict=whole), whole)
        with torch.no_grad():
            if self._reference_transformer is not None:
                return _first_or_whole(self._reference_transformer(**inputs, return_dict=whole), whole)
            if not self.lora_enabled:
                raise RuntimeError("the reference policy was not kept: call enable_reference() before training")
            with adapters_disabled(self.transformer):
                return _first_or_whole(self.transformer(**inputs, return_dict=whole), whole)

    def _merged_transformer(self) -> torch.nn.Module:
        """The transformer with LoRA adapters folded in (a copy), or itself without LoRA."""
        return merge_adapters(self.transformer) if self.lora_enabled else self.transformer


def _first_or_whole(output: Any, whole: bool) -> Any:
    return output if whole else output[0]


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating-point weights to ``dtype``, except the modules the model keeps in fp32
    (diffusers' ``_keep_in_fp32_modules``: e.g. Wan's norms and time embedding), as ``from_pretrained`` does."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    # old tensor's id -> (it, what replaces it), decided at its first name: tied weights stay one tensor
    cast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) not in cast:
                target = torch.float32 if any(k in f"{prefix}.{name}" for k in keep) else dtype
                replacement = tensor
                if tensor.is_floating_point() and tensor.dtype != target:
                    # a new tensor, not ``.data`` swapped under it: a buffer made as a view (SD3's positional
                    # embedding) would keep a base of the old dtype, which torch.compile refuses
                    new = tensor.detach().to(target)
                    replacement = (
                        torch.nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else new
                    )
                cast[id(tensor)] = (tensor, replacement)
            if cast[id(tensor)][1] is not tensor:
                setattr(module, name, cast[id(tensor)][1])


def add_adapters(model: torch.nn.Module, config) -> None:
    """Wrap ``config.target_modules`` of ``model`` in fp32 LoRA adapters (whatever the base weights are).

    peft's own injection, the same for diffusers and transformers models (their ``add_adapter`` wrappers pin
    different peft versions); the config is kept where both libraries and peft look for it."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name="default")
    model.peft_config = {"default": config}
    model._hf_peft_config_loaded = True
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its base model: every peft adapter layer switched off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every peft adapter folded into its base layer and the adapter layers
    removed, so it saves as the stock architecture (a diffusers or a transformers model alike)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(merged.get_submodule(parent) if parent else merged, leaf, module.get_base_layer())
    merged._hf_peft_config_loaded = False  # the libraries' flag that adapters are attached
    if hasattr(merged, "peft_config"):
        del merged.peft_config
    return merged

"""llm-compressor 0.14's AutoRoundModifier, mended where qship's recipes meet it.

- It matches its targets against names relative to the decoder layer, which qship's
  full-name targets never meet, so no per-module scheme reached auto-round: an int8 module
  was tuned and stored at int4 (17 levels in 8 bits), a g64 one failed to fit its scales
  ("shape '[384, 2]' is invalid"). Here the targets are resolved on the whole model and
  matched by identity.
- It ignores only its own unquantized targets, so it re-tuned at its default scheme a
  Linear that another modifier owns (GPTQ at another group size) or none does (a router).
  Here every other Linear of the layer is left alone.
- Its tuning loop runs the layer hundreds of times with the other modifiers' hooks live
  (GPTQ's Hessians, the KV scale observers), and casts the layer to its tuning dtype.
  Here the hooks are off during the loop, and the modules it left take its dtype.
- It unties the word embeddings whenever its *default* targets ("Linear") include the
  output embedding, even when its config groups leave it alone: a tied model's checkpoint
  then stored the embedding twice (Gemma 3 270M: 723 MB instead of 388 MB at the same bits
  per weight) with `tie_word_embeddings: false`. Here it unties only when the modules it
  quantizes include an embedding.
- It carries auto-round's scales back to compressed-tensors but not its zero points, so
  every asymmetric module was stored with zero point 0: the tuned grid [0, 15] - zp read as
  [-8, 7], its ends clamped (Gemma 3 270M: exact KL 0.50 where RTN gives 0.60 and the tuned
  rounding 0.15). Here auto-round's unsigned zero point is stored, shifted to the signed range.

Tested in tests/test_methods.py (each module stored at its group's scheme, and exactly the
weights auto-round tuned).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any


@functools.cache
def autoround_modifier_class() -> Any:
    """The mended AutoRoundModifier subclass (built on first use: llm-compressor is heavy)."""
    import torch
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.modifiers.autoround import AutoRoundModifier as _AutoRoundModifier
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from pydantic import PrivateAttr

    # the same class name: llm-compressor's sequential pipeline turns error propagation off
    # for a modifier whose type is named AutoRoundModifier
    class AutoRoundModifier(_AutoRoundModifier):
        _own: Any = PrivateAttr(default=None)

        def _match_autoround_targets(self, model: Any) -> set[Any]:
            return {m for m in model.modules() if m in self._own}

        def get_unquantized_layer_names(self, wrapped_model: Any) -> list[str]:
            # exact names in auto-round's wrapper (a bare name is matched as a substring)
            return [
                f"model.layers.0.{n}"
                for n, m in wrapped_model.named_modules()
                if isinstance(m, torch.nn.Linear) and m not in self._own
            ]

        def start_calibration(self, model: Any) -> None:
            from llmcompressor.utils import targets_embeddings

            from ..compat.llmcompressor_0_14 import embeddings_stay_tied

            found = list(match_named_modules(model, self.resolved_targets, self.ignore))
            if targets_embeddings(model, found):
                return super().start_calibration(model)
            with embeddings_stay_tied():
                return super().start_calibration(model)

        def _postprocess_qparams(self, model: Any, registered: Any) -> None:
            from compressed_tensors.quantization.utils import calculate_range
            from compressed_tensors.utils import update_offload_parameter

            # auto-round's zero point is unsigned (its grid is [0, 2^bits - 1]);
            # compressed-tensors' grid starts at q_min = -2^(bits - 1)
            zps = {}
            for m in model.modules():
                zp, scheme = getattr(m, "zp", None), getattr(m, "quantization_scheme", None)
                if isinstance(zp, torch.Tensor) and scheme is not None and scheme.weights:
                    if not scheme.weights.symmetric:
                        q_min, _ = calculate_range(scheme.weights, zp.device)
                        zps[m] = zp + q_min
                    del m.zp
            super()._postprocess_qparams(model, registered)
            for m, zp in zps.items():
                if hasattr(m, "weight_zero_point"):
                    held = m.weight_zero_point
                    update_offload_parameter(m, "weight_zero_point",
                                             zp.round().reshape(held.shape).to(held.dtype))  # fmt: skip

        def apply_autoround(self, state: Any, modules: Any) -> None:
            if self._own is None:
                found = match_named_modules(state.model, self.resolved_targets, self.ignore)
                self._own = weakref.WeakSet(m for _, m in found)
            with HooksMixin.disable_hooks():
                super().apply_autoround(state, modules)
            # auto-round leaves the weights it tuned in its tuning dtype; the Linears it
            # left alone follow, so the layer hands the next one a single dtype
            for layer in modules or []:
                mods = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
                dtype = next((m.weight.dtype for m in mods if m in self._own), None)
                params = [p for m in mods if m not in self._own for p in (m.weight, m.bias)]
                for p in params if dtype else []:
                    if p is not None and p.dtype != dtype:
                        p.data = p.data.to(dtype)

    return AutoRoundModifier

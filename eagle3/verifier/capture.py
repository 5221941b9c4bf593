"""The verifier's hidden states as the draft reads them, captured by hooks during its own forward:
the residual stream after each aux layer and the final state before the last norm. Extraction,
online training and decoding with a draft all read them through this one class."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, torch only where a step runs
    import torch

__all__ = ["HiddenStateCapture"]


class HiddenStateCapture:
    """Forward hooks collecting the residual stream at the aux layers and before the final norm."""

    def __init__(self, decoder, aux_layer_ids: list[int]):
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        n = len(decoder.layers)
        for slot, layer_id in enumerate(aux_layer_ids):
            module = decoder.embed_tokens if layer_id == 0 else decoder.layers[layer_id - 1]
            self.handles.append(module.register_forward_hook(self._output_hook(slot)))
        # The last slot is the final PRE-norm state: the input of the final norm, not HF's
        # last output_hidden_states entry (which is post-norm).
        self.handles.append(decoder.norm.register_forward_pre_hook(self._input_hook(len(aux_layer_ids))))
        assert n >= max(aux_layer_ids) + 1

    def _output_hook(self, slot):
        def hook(_module, _args, output):
            self.states[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    def _input_hook(self, slot):
        def hook(_module, args):
            self.states[slot] = args[0]

        return hook

    def stacked(self) -> torch.Tensor:
        # Layers split over devices leave each slot where its layer ran: gather them where the last ran.
        import torch

        last = self.states[max(self.states)]
        return torch.stack([self.states[s].to(last.device) for s in sorted(self.states)], dim=2)  # [batch, seq, 4, H]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

"""The verifier inside training: speculators' hidden-states transfer, computing each batch's states
as the trainer asks for them (`train.hidden_states=online`; the step: `eagle3.training.online`).

speculators' loaders read every sample of every epoch through their transfer's
`get_cached(file_idx)`; `OnlineStates` is such a transfer, so speculators' own dataset, collation,
checks and Trainer run unchanged. `feed` gives each loader's dataset a `__getitems__` (torch's
fetcher calls it with a whole batch's indices where it exists) that prefills the batch's samples
first, longest first, in forwards of at most `budget` padded tokens with the extraction step's
capture hooks; the per-sample path then takes each sample's states once. The states are rounded to
the storage precision (bf16, or FP8 as `eagle3.extraction.storage` stores it) and handed over as
hs-connectors' `FP8Transfer` hands over a file's, so an online draft equals the offline one up to how
the verifier's forwards were batched: padding changes matmul shapes, hence a last bit here and there.

Memory: one batch's states on the training device, taken as read; `keep_bytes` of states in host
memory from one epoch to the next (first come, first kept). Nothing is written. One verifier per
process: the loaders run without workers (each worker would load its own copy), and with DDP each
rank computes its own batches' states with its own replica.
"""

from __future__ import annotations

import torch
from hs_connectors import HiddenStatesTransfer

from eagle3.extraction.extract_hidden_states import prefill_batches
from eagle3.extraction.storage import decode, encode
from eagle3.runtime.devices import compute_dtype
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.placement import load_placed

__all__ = ["OnlineStates", "feed"]


class OnlineStates(HiddenStatesTransfer):
    """States of the samples `prefill` was given, computed by the verifier on `device`, handed to
    speculators' dataset in `dtype` (the training dtype), each once unless kept."""

    def __init__(
        self,
        verifier_path,
        aux_layer_ids: list[int],
        storage: str,
        device: torch.device,
        dtype: torch.dtype,
        budget: int,
        keep_bytes: int = 0,
    ):
        self.decoder = load_placed(verifier_path, compute_dtype(device), device).get_decoder()
        self.capture = HiddenStateCapture(self.decoder, aux_layer_ids)
        self.storage, self.device, self.dtype, self.budget, self.keep_bytes = storage, device, dtype, budget, keep_bytes
        self.ready: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}  # this batch's: file index -> (encoded, token ids)
        self.kept: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}  # in host memory, across epochs
        self.kept_bytes = 0
        self.prefilled_tokens = 0

    @torch.no_grad()  # not inference_mode: the draft's autograd reads these states
    def prefill(self, samples: dict[int, torch.Tensor]) -> None:
        """Compute the states of `samples` (file index -> token ids [seq], on the CPU) not kept.

        Raises:
            RuntimeError: the verifier's states of a sample are not finite (named, with the layer slots).
        """
        self.ready.clear()  # what an earlier batch left (a sample speculators dropped) is not asked for again
        lengths = {i: len(ids) for i, ids in samples.items() if i not in self.kept}
        for batch in prefill_batches(list(lengths), lengths, self.budget):
            width = lengths[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = samples[i]
                mask[row, : lengths[i]] = 1
            self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
            states = self.capture.stacked()  # [batch, width, 4, H]
            self.capture.states.clear()
            for row, i in enumerate(batch):
                self._take(i, states[row, : lengths[i]], samples[i])
            self.prefilled_tokens += sum(lengths[i] for i in batch)

    def _take(self, file_idx: int, states: torch.Tensor, token_ids: torch.Tensor) -> None:
        if not torch.isfinite(states).all():
            slots = (~torch.isfinite(states)).sum(dim=(0, 2)).tolist()
            raise RuntimeError(
                f"sample {file_idx} of the training data: the verifier's states are not finite (per layer slot {slots}); "
                "a verifier in float16, or damaged weights?"
            )
        encoded = encode(states, self.storage)
        self.ready[file_idx] = (encoded, token_ids)
        size = sum(t.nbytes for t in encoded.values()) + token_ids.nbytes
        if self.kept_bytes + size <= self.keep_bytes:
            self.kept[file_idx] = ({name: t.to("cpu") for name, t in encoded.items()}, token_ids)
            self.kept_bytes += size

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        entry = self.kept.get(file_idx) or self.ready.pop(file_idx, None)
        if entry is None:
            raise RuntimeError(f"sample {file_idx} was asked for without its batch prefilled: the loader needs `feed` (and no workers)")
        encoded, token_ids = entry
        return {"hidden_states": decode(encoded, self.dtype).to(self.device), "token_ids": token_ids}  # [seq, 4, H], [seq]

    def get_generated(self, hs_transfer_params: dict) -> None:  # no server: speculators asks only on_missing='generate'
        return None

    def close(self) -> None:
        self.capture.close()
        self.ready.clear()
        self.kept.clear()
        self.decoder = None


class _PrefillBatch:
    """A speculators dataset's `__getitems__`: prefill the batch, then the dataset's own per-sample path."""

    def __init__(self, dataset, states: OnlineStates):
        self.dataset, self.states = dataset, states

    def __call__(self, indices) -> list:
        indices = [int(i) for i in indices]
        self.states.prefill({self.dataset.start_file_idx + i: self.dataset.data[i]["input_ids"] for i in indices})
        return [self.dataset[i] for i in indices]


def feed(loaders, states: OnlineStates) -> None:
    """Have each of speculators' `loaders` (built with `states` as their transfer, no workers) take
    its batches' states from `states`."""
    for loader in loaders:
        if loader.num_workers != 0:
            raise ValueError("online states are computed in the training process: build the loaders with num_workers=0")
        loader.dataset.__getitems__ = _PrefillBatch(loader.dataset, states)
        if states.device.type == "cuda":
            loader.pin_memory = False  # the states are on the GPU already; speculators pins, and pinning refuses CUDA tensors

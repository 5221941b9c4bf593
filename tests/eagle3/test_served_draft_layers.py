"""The verifier layers a served draft reads are the ones its training states were captured at: the
CPU build of vLLM, serving the exported checkpoint, says which layers it captures for the draft. A
checkpoint without them would be served on vLLM's default layers, silently (`eagle3/training/export.py`)."""

from __future__ import annotations

import json
import re

import pytest


@pytest.mark.vllm
def test_the_server_captures_for_the_draft_exactly_the_layers_its_states_came_from(served_draft):
    exported = json.loads((served_draft.checkpoint.path / "config.json").read_text())

    # vLLM's model runner logs this only for ids read from the draft's config; its defaults here would be (1, 2)
    used = re.findall(r"Using auxiliary layers from speculative config: \(([\d, ]*)\)", served_draft.log.read_text())

    assert exported["eagle_aux_hidden_state_layer_ids"] == served_draft.hidden_states.aux_layer_ids == [1, 2, 3]
    assert used and {tuple(int(i) for i in ids.split(",")) for ids in used} == {(1, 2, 3)}

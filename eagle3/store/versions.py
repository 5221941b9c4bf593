"""What each step computes, as a version number: the code's part of every cache key.

A step's cache key is its inputs' digests, its output-affecting config, and the `code_version`
named here: the step's version and the releases of the libraries that compute its output. The key
does not read any source file, so moving a module, renaming a function or fixing a docstring
re-runs nothing (at Kimi-K2.5 scale, re-extracting hidden states costs hours of 8 GPUs and
terabytes of disk). The price: **a change that alters what a step writes must bump its version
here.** `tests/eagle3/test_step_versions.py` runs every step on a tiny verifier and compares its
outputs with the fingerprints pinned for the current versions, so an output change without a bump
fails CI (and a bump without a change of pins, too).

A route that computes a step elsewhere (a vLLM server) has a version of its own: the server's
served model name stands in the key for the server, and local library releases do not shape it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version

__all__ = ["STEPS", "StepCode", "code_version", "route"]


@dataclass(frozen=True)
class StepCode:
    version: int  # bump when the step's output changes
    libraries: tuple[str, ...] = ()  # whose releases can change the output


STEPS: dict[str, StepCode] = {
    "verifier": StepCode(1, ("torch", "transformers", "gguf")),  # a GGUF file's dequantized HF directory
    "regenerated": StepCode(1, ("torch", "transformers")),
    "regenerated/openai": StepCode(1),
    "dataset": StepCode(1, ("tokenizers", "transformers")),
    "hidden_states": StepCode(1, ("torch", "transformers")),  # shard keys too: re-extracting is the cost this table avoids
    "hidden_states/vllm": StepCode(1),
    "vocab_mapping": StepCode(1, ("torch", "speculators")),
    "draft": StepCode(1, ("torch", "transformers", "speculators")),
    "checkpoint": StepCode(1, ("torch", "speculators")),
    "baseline": StepCode(1, ("torch", "transformers")),
    "evaluation": StepCode(1, ("torch", "transformers", "speculators")),
    "evaluation/vllm": StepCode(1),
}


def route(step: str, backend: str, local: str) -> str:
    """The `STEPS` entry of `step` run by `backend` (`local`: the backend that runs in the step)."""
    return step if backend == local else f"{step}/{backend}"


def code_version(step: str) -> str:
    """e.g. 'draft v1 (torch 2.13.0, transformers 5.19.0, speculators 0.9.0)'."""
    code = STEPS[step]
    libraries = ", ".join(f"{package} {version(package)}" for package in code.libraries)
    return f"{step} v{code.version}" + (f" ({libraries})" if libraries else "")

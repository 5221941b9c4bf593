from __future__ import annotations

import shutil

import pytest

from tiny_models import tiny_llama
from eagle3.config import VerifierConfig
from eagle3.store import ArtifactError, ArtifactStore
from eagle3.verifier import resolve_verifier


def test_missing_tokenizer_names_the_directory(tiny_verifier, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_verifier, broken)
    (broken / "tokenizer.json").unlink()

    with pytest.raises(ArtifactError, match=r"no-tokenizer: missing tokenizer"):
        resolve_verifier(VerifierConfig(path=str(broken)), ArtifactStore(tmp_path / "s"))


def test_a_tokenizer_without_chat_template_is_refused_naming_the_directory(tmp_path):
    base = tiny_llama(tmp_path / "base-model", template=None)

    with pytest.raises(ArtifactError, match=r"base-model: the tokenizer has no chat template"):
        resolve_verifier(VerifierConfig(path=str(base)), ArtifactStore(tmp_path / "s"))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ArtifactError, match=r"nowhere: verifier.path does not exist"):
        resolve_verifier(VerifierConfig(path=str(tmp_path / "nowhere")), ArtifactStore(tmp_path / "s"))


def test_hf_directory_is_used_in_place_and_described(tiny_verifier, tmp_path):
    manifest = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), ArtifactStore(tmp_path / "s"))

    assert manifest.path == tiny_verifier
    assert (manifest.num_hidden_layers, manifest.hidden_size, manifest.vocab_size, manifest.nested) == (4, 64, 1024, False)

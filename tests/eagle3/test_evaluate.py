from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CLAIM_WAIT_S, SAMPLE, run_while_another_run_holds_the_step, work_dir_path, write_jsonl
from tiny_models import CHATML, tiny_llama

from eagle3.config import DatasetConfig, EndpointConfig, EvalConfig, ExportConfig, ExtractConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.evaluation import baseline
from eagle3.evaluation import evaluate as evaluate_module
from eagle3.evaluation.baseline import (
    BaselineManifest,
    DecodingModel,
    baseline_provenance,
    chat_prompts,
    decode_summary,
    measure_baselines,
    read_prompts,
)
from eagle3.evaluation.draft_proposer import Eagle3Proposer, StaticEagle3Proposer, draft_token_accuracy
from eagle3.evaluation.evaluate import EvalManifest, eval_prompts_source, evaluate, evaluation_provenance, load_draft
from eagle3.evaluation.given_draft import given_draft, given_draft_provenance
from eagle3.evaluation.served_acceptance import read_spec_decode_counters
from eagle3.evaluation.speculative import NgramProposer, greedy_decode, speculative_decode
from eagle3.evaluation.tau import tau_from_counts
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.serving.endpoint import EndpointError
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.done_log import DONE_LOG
from eagle3.store.manifests import MANIFEST, Provenance
from eagle3.training.export import export_checkpoint
from eagle3.training.train import train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import DynamicForward, StaticForward
from eagle3.verifier.loading import eos_token_ids, load_text_model, load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # speculative decoding of real prompts, resumed and killed evaluations

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def exported(tiny_verifier, tmp_path_factory):
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=AUX), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    # Two draft layers: each keeps its own KV cache while drafting, which one layer would not exercise.
    draft = train_draft(TrainConfig(epochs=2, total_seq_len=512, num_layers=2), dataset, hidden, vocab, verifier, store, Provenance())
    checkpoint = export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, Provenance())
    return store, verifier, hidden, checkpoint


@pytest.fixture(scope="module")
def exported_fc_norm(exported):
    """A draft with EAGLE 3.1's per-layer norms of the aux states (train.fc_norm), on `exported`'s store and data."""
    store, verifier, hidden, _ = exported
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    own = Provenance(config={"fc_norm": True})  # not `exported`'s key: the store would hand back its draft
    draft = train_draft(TrainConfig(epochs=1, total_seq_len=512, fc_norm=True), dataset, hidden, vocab, verifier, store, own)
    return store, verifier, hidden, export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, own)


@pytest.fixture(scope="module")
def verifier_model(exported):
    _, verifier, _, _ = exported
    model = load_text_model(verifier.path, torch.float64, "cpu")
    capture = HiddenStateCapture(model.get_decoder(), AUX)
    yield model, capture
    capture.close()


PROMPT = [1, 200, 300, 400, 500, 600, 700]


class OracleProposer:
    """Proposes the reference continuation: every draft must be accepted."""

    def __init__(self, reference, prompt_len):
        self.reference, self.prompt_len = reference, prompt_len

    def reset(self):
        pass

    def observe(self, aux):
        pass

    def propose(self, context, k):
        done = len(context) - self.prompt_len
        return self.reference[done : done + k]


@pytest.mark.parametrize("kind", ["dynamic", "static"])  # a CPU's forward, and a GPU's (eagerly)
def test_speculative_output_equals_plain_greedy_for_every_proposer(exported, verifier_model, kind):
    _store, verifier, _hidden, checkpoint = exported
    model, capture = verifier_model
    draft = Eagle3Proposer(load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double())
    forward = DynamicForward(model, capture) if kind == "dynamic" else StaticForward(model, capture, len(PROMPT) + 40)
    reference = greedy_decode(forward, PROMPT, 40, set())
    hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None)[0, len(PROMPT) :]

    assert reference.tokens == hf.tolist()
    static = [StaticEagle3Proposer(draft.draft, len(PROMPT) + 40)] if kind == "static" else []  # as a GPU pairs them
    for proposer in (draft, *static, NgramProposer()):
        for k in (1, 3, 5):
            run = speculative_decode(forward, proposer, PROMPT, 40, k, set())
            assert run.tokens == reference.tokens, (type(proposer).__name__, k)


def test_acceptance_is_counted_per_verifier_pass(verifier_model):
    forward = DynamicForward(*verifier_model)
    reference = greedy_decode(forward, PROMPT, 25, set()).tokens

    oracle = speculative_decode(forward, OracleProposer(reference, len(PROMPT)), PROMPT, 25, 4, set())
    nothing = speculative_decode(forward, NgramProposer(max_n=99, min_n=99), PROMPT, 25, 4, set())

    assert oracle.tokens == reference
    assert oracle.accepted_per_pass[:4] == [4, 4, 4, 4] and oracle.verifier_passes == 5
    assert nothing.accepted_per_pass == [0] * 24


class _SlowPasses:
    """A verifier forward whose prompt pass (the one given a list of ids) takes `prompt_s` longer and
    every later pass `pass_s` longer."""

    def __init__(self, forward, prompt_s: float, pass_s: float):
        self.forward, self.prompt_s, self.pass_s = forward, prompt_s, pass_s

    def __getattr__(self, name):
        return getattr(self.forward, name)

    def __call__(self, ids):
        time.sleep(self.prompt_s if isinstance(ids, list) else self.pass_s)
        return self.forward(ids)


def test_each_decode_times_its_first_token_apart(verifier_model):
    """The prompt's pass, up to the first token, is timed apart from the whole decode: the part a
    draft cannot shorten (`decode_tokens_per_s` leaves it out)."""
    forward = _SlowPasses(DynamicForward(*verifier_model), prompt_s=0.3, pass_s=0.02)
    greedy = greedy_decode(forward, PROMPT, 12, set())
    drafted = speculative_decode(forward, OracleProposer(greedy.tokens, len(PROMPT)), PROMPT, 12, 4, set())

    for run in (greedy, drafted):
        assert 0.3 <= run.first_token_seconds < run.seconds  # the prompt's pass is in it
        assert run.seconds - run.first_token_seconds >= 0.02 * (run.verifier_passes - 1)  # the later passes are not


def test_acceptance_by_position_is_over_the_passes_that_drafted_there(verifier_model):
    """vLLM divides each position's accepted drafts by its drafts: a pass near the answer's end
    drafts fewer than k, and n-gram drafts nothing without a match; neither counts as a rejection."""
    forward = DynamicForward(*verifier_model)
    reference = greedy_decode(forward, PROMPT, 12, set()).tokens

    oracle = speculative_decode(forward, OracleProposer(reference, len(PROMPT)), PROMPT, 12, 4, set())
    nothing = speculative_decode(forward, NgramProposer(max_n=99, min_n=99), PROMPT, 12, 4, set())

    assert oracle.tokens == reference
    assert (oracle.accepted_per_pass, oracle.drafted_per_pass) == ([4, 4, 1], [4, 4, 1])  # 1 + 5 + 5 + 1 tokens
    assert decode_summary("eagle3", 4, [oracle], [oracle])["acceptance_by_position"] == [1.0, 1.0, 1.0, 1.0]
    assert nothing.drafted_per_pass == [0] * 11
    assert decode_summary("ngram", 4, [nothing], [oracle])["acceptance_by_position"] == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("norms", ["norm_before_fc", "fc_norm"])
def test_every_drafted_token_matches_its_training_forward(norms, request, verifier_model):
    """Each step of a k-token chain computes what the training-time forward computes at that TTT
    step: run on the context followed by the chain (which is what teacher forcing feeds each later
    step), the training forward gives the same logits at the context's last position. With either
    normalization of the aux states: one norm over their concatenation, or EAGLE 3.1's per layer."""
    _store, verifier, _hidden, checkpoint = request.getfixturevalue("exported_fc_norm" if norms == "fc_norm" else "exported")
    model, capture = verifier_model
    draft = load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double()
    exported_config = json.loads((checkpoint.path / "config.json").read_text())
    assert (exported_config["fc_norm"], exported_config["norm_before_fc"]) == (norms == "fc_norm", norms == "norm_before_fc")
    assert (draft.fc_norm is not None, draft.input_norm is not None) == (norms == "fc_norm", norms == "norm_before_fc")
    logits = []
    hook = draft.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0]))
    context = [*PROMPT, 900]
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPT]))
    proposer = Eagle3Proposer(draft)
    proposer.observe(capture.stacked()[0, :, :-1])
    k = 3

    chain = proposer.propose(context, k).tolist()
    drafted, logits = [step[-1] for step in logits], []

    sequence = context + chain
    with torch.no_grad():
        model(input_ids=torch.tensor([sequence]))
    aux = capture.stacked()[0, :-1, :-1]  # states of sequence[:-1]: what the shifted batch pairs with sequence[1:]
    n = len(sequence) - 1
    with torch.no_grad():
        draft(
            hidden_states=aux.reshape(1, n, -1),
            input_ids=torch.tensor([sequence[1:]]),
            document_ids=torch.zeros(1, n, dtype=torch.long),
            position_ids=torch.arange(1, n + 1)[None],
            ttt_steps=k,
        )
    hook.remove()
    at_last_context_token = len(context) - 2
    trained = [step[at_last_context_token] for step in logits]
    assert len(drafted) == len(trained) == k
    for step, (ours, theirs) in enumerate(zip(drafted, trained)):
        torch.testing.assert_close(ours, theirs, msg=lambda m, step=step: f"TTT step {step}: {m}")
    assert chain == [int(t.argmax()) + int(draft.d2t[int(t.argmax())]) for t in trained]


def test_step_0_extended_round_by_round_proposes_what_step_0_over_the_whole_context_proposes(exported, verifier_model):
    """The proposer runs step 0 once per confirmed position, extending its cache by the tokens each
    round confirmed (1 to k + 1) and cropping the chained steps' entries after proposing: each
    round's chain and step-0 state equal a fresh proposer's given the whole context at once."""
    _store, verifier, _hidden, checkpoint = exported
    model, capture = verifier_model
    draft = load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double()
    sequence = PROMPT + greedy_decode(DynamicForward(model, capture), PROMPT, 20, set()).tokens
    with torch.no_grad():
        model(input_ids=torch.tensor([sequence]))
    aux = capture.stacked()[0, :, :-1]  # aux[i]: the states of sequence[i]
    proposer, confirmed = Eagle3Proposer(draft), len(PROMPT)
    proposer.observe(aux[:confirmed])

    for accepted, k in [(0, 3), (3, 3), (0, 1), (1, 1), (2, 3), (0, 3), (3, 3)]:  # each round confirms accepted + 1 tokens
        context = sequence[: confirmed + 1]
        chain = proposer.propose(context, k).tolist()
        fresh = Eagle3Proposer(draft)
        fresh.observe(aux[:confirmed])
        assert chain == fresh.propose(context, k).tolist(), confirmed
        torch.testing.assert_close(proposer.last, fresh.last)
        assert proposer.cache.get_seq_length() == confirmed  # the chained steps' entries are gone
        proposer.observe(aux[confirmed : confirmed + accepted + 1])
        confirmed += accepted + 1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-rounds", "compiled-rounds"])
def test_the_draft_on_fixed_buffers_proposes_what_it_proposes_on_transformers_cache(exported, verifier_model, compiled):
    """`StaticEagle3Proposer`'s rounds (eager or through torch.compile here, as a GPU's graphs replay
    them) draft what `Eagle3Proposer`'s draft, round after round with 1 to k + 1 tokens confirmed
    between them: the fixed buffers, positions, mask, the zeroed chained entries and the fused
    kernels change nothing but speed (in float64, where fusion's rounding cannot flip an argmax)."""
    _store, verifier, _hidden, checkpoint = exported
    model, capture = verifier_model
    draft = load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double()
    sequence = PROMPT + greedy_decode(DynamicForward(model, capture), PROMPT, 24, set()).tokens
    with torch.no_grad():
        model(input_ids=torch.tensor([sequence]))
    aux = capture.stacked()[0, :, :-1]
    static = StaticEagle3Proposer(draft, len(sequence) + 2, compiled=compiled)
    eager, confirmed = Eagle3Proposer(draft), len(PROMPT)
    assert not static.graphs and static.compiled == compiled  # on a CPU
    for proposer in (eager, static):
        proposer.observe(aux[:confirmed])

    for accepted, k in [(0, 3), (3, 3), (0, 1), (1, 1), (2, 3), (0, 3), (3, 3), (1, 5)]:
        context = sequence[: confirmed + 1]
        assert static.propose(context, k).tolist() == eager.propose(context, k).tolist(), confirmed
        for proposer in (eager, static):
            proposer.observe(aux[confirmed : confirmed + accepted + 1])
        confirmed += accepted + 1
    used = static.static_cache.keys[0][0, 0]  # [max_len, head_dim] of the first layer's first head
    assert used[: static.positions].abs().sum(-1).gt(0).all() and not used[static.positions :].any()  # chained entries zeroed
    short = StaticEagle3Proposer(draft, len(PROMPT) + 1)
    short.observe(aux[: len(PROMPT)])
    with pytest.raises(ValueError, match="outgrows the KV buffers"):
        short.propose(sequence[: len(PROMPT) + 1], 3)


def test_teacher_forced_first_tokens_are_the_proposals_and_the_training_step_0(exported, verifier_model):
    """`first_tokens` is what `propose` drafts first after every prefix, and the argmax of the
    training forward's step-0 logits at every position: the per-token accuracy validation reports."""
    _store, verifier, _hidden, checkpoint = exported
    model, capture = verifier_model
    draft = load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double()
    sequence = [*PROMPT, 900, 17, 400, 52, 3, 71]
    with torch.no_grad():
        model(input_ids=torch.tensor([sequence]))
    aux = capture.stacked()[0, :-1, :-1]  # states of sequence[:-1]
    proposer = Eagle3Proposer(draft)

    predicted = proposer.first_tokens(sequence, aux)

    assert len(predicted) == len(sequence) - 1
    for end in range(2, len(sequence) + 1):
        proposer.reset()
        proposer.observe(aux[: end - 1])
        assert proposer.propose(sequence[:end], 1).tolist() == [predicted[end - 2]], end
    logits = []
    hook = draft.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0]))
    n = len(sequence) - 1
    with torch.no_grad():
        draft(
            hidden_states=aux.reshape(1, n, -1),
            input_ids=torch.tensor([sequence[1:]]),
            document_ids=torch.zeros(1, n, dtype=torch.long),
            position_ids=torch.arange(1, n + 1)[None],
            ttt_steps=1,
        )
    hook.remove()
    step0 = logits[0].argmax(-1)
    assert predicted == (step0 + draft.d2t[step0]).tolist()


def test_draft_token_accuracy_counts_each_first_proposal_against_the_next_token(exported, verifier_model):
    """A continuation built from the draft's own first proposals, with every third one replaced:
    exactly the kept ones count as correct (the first token is the verifier's own, never drafted)."""
    _store, verifier, _hidden, checkpoint = exported
    model, capture = verifier_model
    proposer = Eagle3Proposer(load_draft(checkpoint.path, verifier.path, torch.device("cpu")).double())
    continuation = [900]
    for m in range(1, 12):
        context = PROMPT + continuation
        with torch.no_grad():
            model(input_ids=torch.tensor([context[:-1]]))
        proposer.reset()
        proposer.observe(capture.stacked()[0, :, :-1])
        [proposed] = proposer.propose(context, 1).tolist()
        continuation.append(proposed if m % 3 else (proposed + 1) % 900)

    assert draft_token_accuracy(model, capture, proposer, PROMPT, continuation) == (8, 11)


def test_in_vocabulary_counts_the_tokens_the_draft_vocabulary_holds(exported):
    _store, verifier, _hidden, checkpoint = exported
    proposer = Eagle3Proposer(load_draft(checkpoint.path, verifier.path, torch.device("cpu")))
    inside = proposer.draft.t2d.nonzero().flatten()[:3].tolist()
    outside = (~proposer.draft.t2d).nonzero().flatten()[:2].tolist()
    assert len(inside) == 3 and len(outside) == 2  # the tiny draft's vocabulary is smaller than the verifier's

    assert proposer.in_vocabulary(inside + outside + inside[:1]) == 4
    assert proposer.in_vocabulary(outside) == 0


@pytest.fixture(scope="module")
def two_prompts(exported):
    """Two eval prompts and their baselines."""
    store, verifier, _, _ = exported
    cfg = EvalConfig(num_prompts=2, max_new_tokens=24, ks=[2, 4])
    prompts = write_jsonl(store.root / "prompts.jsonl", [{"turns": ["What is 2 + 3?", "And 4?"]}, {"question": "Count to five."}])
    return cfg, prompts, measure_baselines(cfg, verifier, prompts, store, Provenance(config={"prompts": "two"}))


def test_a_prompt_the_chat_template_refuses_names_file_and_record_before_a_gpu_is_claimed(tmp_path):
    """Some templates insist on a system message first; eval prompts are single user turns."""
    needs_system = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}" + CHATML
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_llama(tmp_path / "strict", template=needs_system))), store)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"question_id": 81, "turns": ["Hi"]}, {"prompt": "Bye"}])
    claims = []

    with pytest.raises(
        ArtifactError,
        match=r"prompts\.jsonl: record id '81': the verifier's chat template refused its first "
        r"user turn: a system message must come first",
    ):
        measure_baselines(EvalConfig(num_prompts=2), verifier, prompts, store, Provenance(), claim=lambda: counted_claim(claims))
    assert claims == []


def test_two_baselines_with_the_same_outputs_keep_their_own_measurements(exported, two_prompts):
    """Another run's baselines of the same prompts (another key) decode the same tokens at other
    speeds: its own artifact and manifest, not the first run's, since the measurements are in the files."""
    store, verifier, _, _ = exported
    cfg, prompts, first = two_prompts

    again = measure_baselines(cfg, verifier, prompts, store, Provenance(config={"prompts": "two, measured again"}))

    assert again.reference() == first.reference() and again.digest != first.digest
    for measured in (first, again):
        assert store.load(BaselineManifest, measured.digest).results == measured.results
        assert json.loads((measured.path / "report.json").read_text())["results"] == measured.results


def test_baselines_hold_the_verifiers_plain_greedy_output_of_each_chat_templated_prompt(exported, two_prompts):
    _, verifier, _, _ = exported
    cfg, _, baselines = two_prompts
    tokenizer = load_tokenizer(verifier.path)
    model = load_text_model(verifier.path, torch.float32, "cpu")
    eos = eos_token_ids(tokenizer, model)

    for text, reference in zip(["What is 2 + 3?", "Count to five."], baselines.reference(), strict=True):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert reference == greedy_decode(DynamicForward(model, None), list(prompt), cfg.max_new_tokens, eos).tokens
    assert baselines.num_tokens == sum(map(len, baselines.reference()))
    assert [(r["method"], r["k"]) for r in baselines.results] == [("ngram", 2), ("ngram", 4)]
    assert baselines.mismatches == 0 and baselines.measured_on.startswith("cpu")
    assert baselines.measured_on.endswith("; transformers' dynamic KV cache")  # speeds depend on the forward too
    for row in baselines.results:  # the per-prompt counts kept for paired gains add up to the row
        counts = baselines.counts("ngram", row["k"])
        assert len(counts) == 2 and tau_from_counts(counts) == pytest.approx(row["tau"])
    assert baselines.counts("ngram", 3) is None  # k not measured


def test_evaluate_reports_tau_per_method_and_k_with_the_baselines_rows(exported, two_prompts):
    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts

    manifest = evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(), baselines)

    assert manifest.mismatches == 0 and manifest.num_prompts == 2
    assert [(r["method"], r["k"]) for r in manifest.results] == [("eagle3", 2), ("eagle3", 4), ("ngram", 2), ("ngram", 4)]
    assert manifest.results[2:] == baselines.results
    assert manifest.num_tokens == baselines.num_tokens
    assert manifest.greedy_measured_on == manifest.measured_on  # greedy decoded in the step, beside the draft
    assert manifest.baselines_measured_on == baselines.measured_on  # where the n-gram rows' speeds come from
    for r in manifest.results:  # each row's speed-up over the greedy decodes beside its own
        greedy = baselines.greedy_tokens_per_s if r["method"] == "ngram" else manifest.greedy_tokens_per_s
        assert r["greedy_tokens_per_s"] == greedy and r["speed_up"] == pytest.approx(r["tokens_per_s"] / greedy)
        assert manifest.speed_up(r) == r["speed_up"]
        # the same after each prompt's first token, over the same greedy decodes
        assert r["decode_tokens_per_s"] > 0.0 and r["greedy_decode_tokens_per_s"] > 0.0
        assert r["decode_speed_up"] == pytest.approx(r["decode_tokens_per_s"] / r["greedy_decode_tokens_per_s"])
    for r in manifest.results:
        assert 1.0 <= r["tau"] <= r["k"] + 1
        assert len(r["acceptance_by_position"]) == r["k"]
        shares = [drafts / r["verifier_passes"] for drafts in r["drafts_by_position"]]
        assert r["tau"] == pytest.approx(1 + sum(a * share for a, share in zip(r["acceptance_by_position"], shares, strict=True)))
        assert r["tau_standard_error"] >= 0.0  # two prompts: a spread is measured
        assert r["tokens"] == baselines.num_tokens  # every decode is the greedy output
    taus = {(r["method"], r["k"]): r["tau"] for r in manifest.results}
    for (method, k), tau in taus.items():  # each prompt's counts, kept to break tau down, add up to the row
        counts = manifest.counts(method, k)
        assert len(counts) == 2 and tau_from_counts(counts) == pytest.approx(tau)
    assert manifest.counts("eagle3", 3) is None  # k not measured
    assert [g["k"] for g in manifest.gains_over_ngram] == [2, 4]
    for g in manifest.gains_over_ngram:
        assert g["gain"] == pytest.approx(taus["eagle3", g["k"]] - taus["ngram", g["k"]]) and g["standard_error"] >= 0.0
    report = json.loads((manifest.path / "report.json").read_text())
    assert (report["results"], report["gains_over_ngram"]) == (manifest.results, manifest.gains_over_ngram)
    assert 0.0 <= manifest.draft_token_accuracy <= manifest.draft_vocab_coverage <= 1.0  # never right outside its vocabulary


def test_bumping_the_evaluation_version_reevaluates_drafts_and_keeps_the_baselines(exported, two_prompts, monkeypatch):
    """A change to how drafts are decoded bumps `evaluation` in eagle3.store.versions: the baselines (greedy
    and n-gram decoding) have a version of their own, so they stay cached."""
    from eagle3.store import versions

    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts
    before = (
        baseline.baseline_provenance(store, cfg, verifier, prompts).key,
        evaluation_provenance(store, cfg, checkpoint, verifier, prompts, baselines).key,
    )
    bumped = versions.StepCode(versions.STEPS["evaluation"].version + 1, versions.STEPS["evaluation"].libraries)
    monkeypatch.setitem(versions.STEPS, "evaluation", bumped)

    assert baseline.baseline_provenance(store, cfg, verifier, prompts).key == before[0]
    assert evaluation_provenance(store, cfg, checkpoint, verifier, prompts, baselines).key != before[1]


def test_a_draft_output_that_differs_from_the_baselines_greedy_output_is_a_mismatch(exported, two_prompts, tmp_path):
    import shutil

    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts
    altered = shutil.copytree(baselines.path, tmp_path / "altered")
    references = baselines.reference()
    references[1][-1] = 1 if references[1][-1] != 1 else 2  # the second prompt's last greedy token
    (altered / "reference.json").write_text(json.dumps(references))

    manifest = evaluate(
        cfg,
        checkpoint,
        verifier,
        prompts,
        store,
        Provenance(config={"run": "altered"}),
        baselines.model_copy(update={"path": altered}),
    )

    assert manifest.mismatches == len(cfg.ks) + 1  # that prompt's decode at each k, and its plain greedy one


def _given(checkpoint, tmp_path: Path, edit=None) -> Path:
    """A copy of `checkpoint`'s files, as a draft exported on another host arrives; `edit` changes its config."""
    import shutil

    path = shutil.copytree(checkpoint.path, tmp_path / "exported-elsewhere", ignore=shutil.ignore_patterns(MANIFEST))
    if edit is not None:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


def _refused_unpublished(path: Path, verifier, tmp_path: Path, message: str) -> None:
    """Importing the draft at `path` into a fresh store fails with `message` and publishes nothing."""
    store = ArtifactStore(tmp_path / "other-store")
    with pytest.raises(ArtifactError, match=message):
        given_draft(path, ExportConfig(), verifier, store, given_draft_provenance(store, path, ExportConfig(), verifier))
    assert not any(store.root.rglob("*.safetensors")) and not (store.root / "published").exists()  # not even in a work dir


def test_a_draft_trained_elsewhere_measures_what_the_same_draft_trained_here_does(exported, two_prompts, tmp_path):
    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts
    other_store = ArtifactStore(tmp_path / "other-store")
    path = _given(checkpoint, tmp_path)

    given = given_draft(path, ExportConfig(), verifier, other_store, given_draft_provenance(other_store, path, ExportConfig(), verifier))
    (path / "config.json").write_text("{}")  # the source may change or go: the store holds its own copy

    assert given.digest == checkpoint.digest and given.path.parent == other_store.root / "artifacts"
    assert given.tau_sim is None and given.selected_epoch is None  # nothing about its training is known here
    here = evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(config={"draft": "trained here"}), baselines)
    elsewhere = evaluate(cfg, given, verifier, prompts, other_store, Provenance(config={"draft": "given"}), baselines)
    taus = [[(r["method"], r["k"], r["tau"]) for r in e.results] for e in (here, elsewhere)]
    assert taus[0] == taus[1] and elsewhere.mismatches == 0 and elsewhere.tau_sim is None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(speculators_model_type="mlp"), r"field 'speculators_model_type' is 'mlp': only EAGLE-3 drafts"),
        (
            lambda c: c["transformer_layer_config"].update(hidden_size=32),
            r"field 'transformer_layer_config.hidden_size' is 32, but the verifier .* has 64: a draft for another verifier",
        ),
        (lambda c: c["transformer_layer_config"].update(vocab_size=7), r"field 'transformer_layer_config.vocab_size' is 7, but"),
        (
            lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]),
            r"field 'eagle_aux_hidden_state_layer_ids' is \[1, 2, 9\]: expected the distinct verifier layers the draft reads, each in 0..3",
        ),
        (
            lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 1, 2]),
            r"field 'eagle_aux_hidden_state_layer_ids' is \[1, 1, 2\]: expected the distinct",
        ),
    ],
)
def test_a_given_draft_that_does_not_fit_the_verifier_is_refused_naming_its_config_field(exported, tmp_path, edit, message):
    _store, verifier, _hidden, checkpoint = exported
    path = _given(checkpoint, tmp_path, edit)

    _refused_unpublished(path, verifier, tmp_path, rf"{path / 'config.json'}: {message}")


@pytest.mark.parametrize(
    ("tensor", "change", "message"),
    [
        ("fc.weight", "drop", r"tensor 'fc\.weight' is missing, expected shape \[64, 192\]"),
        ("d2t", "drop", r"tensor 'd2t' is missing, expected shape \[512\]"),
        ("fc.weight", "cut", r"tensor 'fc\.weight' is of shape \[64, 191\], expected shape \[64, 192\] for this verifier and config"),
    ],
)
def test_given_weights_a_server_would_miss_are_refused_by_tensor_and_nothing_is_written(exported, tmp_path, tensor, change, message):
    """transformers only warns about a missing weight, and speculators skips some on purpose: checked from the headers."""
    from safetensors.torch import load_file, save_file

    _store, verifier, _hidden, checkpoint = exported
    path = _given(checkpoint, tmp_path)
    weights = load_file(path / "model.safetensors")
    if change == "drop":
        del weights[tensor]
    else:
        weights[tensor] = weights[tensor][:, :-1].contiguous()
    save_file(weights, path / "model.safetensors")

    _refused_unpublished(path, verifier, tmp_path, rf"{path / 'model.safetensors'}: {message}")


def test_a_given_draft_the_store_already_holds_is_that_artifact_with_its_training_figures(exported, tmp_path):
    store, verifier, _hidden, checkpoint = exported
    path = _given(checkpoint, tmp_path)
    provenance = given_draft_provenance(store, path, ExportConfig(), verifier)

    given = given_draft(path, ExportConfig(), verifier, store, provenance)

    assert given.digest == checkpoint.digest and given.tau_sim == checkpoint.tau_sim and given.epochs == checkpoint.epochs
    assert store.published(type(given), provenance) == given  # what a later run on this store reads


def test_a_given_draft_names_the_verifier_export_verifier_name_or_path_gives(exported, tmp_path):
    _store, verifier, _hidden, checkpoint = exported
    path = _given(checkpoint, tmp_path)
    store, cfg = ArtifactStore(tmp_path / "other-store"), ExportConfig(verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")

    given = given_draft(path, cfg, verifier, store, given_draft_provenance(store, path, cfg, verifier))

    assert (
        json.loads((given.path / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == cfg.verifier_name_or_path
    )
    assert given.verifier_name_or_path == cfg.verifier_name_or_path and given.digest != checkpoint.digest


def test_baselines_of_other_prompts_are_refused_by_name(exported, two_prompts):
    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts

    with pytest.raises(ArtifactError, match=rf"{baselines.path}: baselines of 2 prompts for an evaluation of 1"):
        evaluate(cfg.model_copy(update={"num_prompts": 1}), checkpoint, verifier, prompts, store, Provenance(config={"n": 1}), baselines)


def test_baselines_measured_with_other_settings_are_refused_by_field(exported, two_prompts):
    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, _ = two_prompts
    short = cfg.model_copy(update={"max_new_tokens": 8})
    baselines = measure_baselines(short, verifier, prompts, store, baseline_provenance(store, short, verifier, prompts))

    with pytest.raises(
        ArtifactError, match=rf"{baselines.path}: baselines measured otherwise than this evaluation decodes \(config.max_new_tokens\)"
    ):
        evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(config={"settings": "other"}), baselines)


def test_baselines_are_keyed_by_device_type_and_decoding_not_by_the_eval_backend_or_a_files_location(exported, two_prompts):
    """A CPU-measured baseline is never handed to a CUDA evaluation, whose outputs are checked against its reference."""
    store, verifier, _, _ = exported
    cfg, prompts, _ = two_prompts
    moved = write_jsonl(store.root / "moved-prompts.jsonl", [json.loads(line) for line in prompts.read_text().splitlines()])

    def key(prompts_file=prompts, **settings):
        return baseline.baseline_provenance(store, cfg.model_copy(update=settings), verifier, prompts_file).key

    assert key() == key(device="cpu") == key(moved, prompts_path=str(moved))
    assert key() == key(backend="vllm", endpoint=EndpointConfig(model="verifier", base_url="http://gpu-host/v1"))
    assert len({key(), key(device="cuda"), key(dtype="bfloat16"), key(ks=[3]), key(max_new_tokens=8), key(num_prompts=1)}) == 6


def test_a_prompts_file_that_is_not_there_is_named_before_anything_runs(tmp_path):
    missing = tmp_path / "mt_bench.jsonl"

    with pytest.raises(ArtifactError, match=rf"{missing}: evaluate.prompts_path does not exist or is not a file"):
        eval_prompts_source(EvalConfig(prompts_path=str(missing)))


@contextmanager
def counted_claim(claims: list):
    claims.append(time.monotonic())
    yield None  # no GPU: the step decodes on its configured device


def plant_done_log(store, kind: str, provenance: Provenance, entries: list[dict], torn: str = "") -> None:
    """What a run killed midway leaves in the step's work directory (a last line cut short: `torn`)."""
    log = work_dir_path(store, kind, provenance.key) / DONE_LOG
    log.write_text("".join(json.dumps(entry) + "\n" for entry in entries) + torn)


@pytest.fixture(scope="module")
def baseline_entries(exported, two_prompts, tmp_path_factory):
    """Each prompt's finished baseline decodes, logged by the step's own per-prompt loop."""
    _, verifier, _, _ = exported
    cfg, prompts, _ = two_prompts
    on = DecodingModel.load(verifier, chat_prompts(verifier, read_prompts(prompts, cfg.num_prompts), prompts), cfg.device, cfg.dtype)
    done = baseline._decode_prompts(on, cfg, {}, tmp_path_factory.mktemp("baseline_log") / DONE_LOG)
    return [done[0], done[1]]


def tagged(entry: dict, method: str, seconds: float, **update) -> dict:
    """`entry` with the seconds of its `method` decode ('greedy', or a k of the draft's 'runs') set
    to `seconds`: a figure only a reused entry can put into the speeds."""
    entry = copy.deepcopy(entry) | update
    (entry["runs"][method] if method.isdigit() else entry[method])["seconds"] = seconds
    return entry


def test_a_killed_baselines_run_resumes_at_its_first_undecoded_prompt(exported, two_prompts, baseline_entries):
    store, verifier, _, _ = exported
    cfg, prompts, full = two_prompts
    provenance, claims = Provenance(config={"run": "killed after one prompt"}), []
    plant_done_log(
        store, "baseline", provenance, [tagged(baseline_entries[0], "greedy", 1000.0)], torn=json.dumps(baseline_entries[1])[:40]
    )

    resumed = measure_baselines(cfg, verifier, prompts, store, provenance, claim=lambda: counted_claim(claims))

    assert len(claims) == 1  # a prompt was left to decode
    assert resumed.reference() == full.reference() and resumed.mismatches == 0
    assert [(r["k"], r["tau"], r["acceptance_by_position"]) for r in resumed.results] == [
        (r["k"], r["tau"], r["acceptance_by_position"]) for r in full.results
    ]
    assert resumed.greedy_tokens_per_s < resumed.num_tokens / 1000.0  # the first prompt's logged decode was kept
    assert sorted(p.name for p in resumed.path.iterdir()) == ["manifest.json", "per_prompt.json", "reference.json", "report.json"]
    assert not (store.root / "work" / f"baseline-{provenance.key[:24]}").exists()  # the log went with the work dir


def test_an_earlier_evaluations_speed_up_is_only_over_greedy_decoded_on_the_same_device_and_forward(tmp_path):
    """Evaluations before version 5 kept no speed-up in their rows: theirs is over the baselines' greedy."""
    on_h100 = EvalManifest(
        path=tmp_path,
        num_prompts=1,
        num_tokens=10,
        tau_sim=2.0,
        results=[],
        greedy_tokens_per_s=100.0,
        mismatches=0,
        measured_on="H100; graphs",
        greedy_measured_on="H100; graphs",
    )

    row = {"method": "eagle3", "k": 3, "tokens_per_s": 180.0}
    assert on_h100.speed_up(row) == 1.8 and on_h100.speed_up({"method": "eagle3", "k": 3}) is None
    assert on_h100.model_copy(update={"greedy_measured_on": "H200; graphs"}).speed_up(row) is None  # a cached baseline's GPU
    assert on_h100.model_copy(update={"greedy_measured_on": None}).speed_up(row) == 1.8  # recorded before the field was
    assert on_h100.speed_up(row | {"speed_up": 1.5}) == 1.5  # a row's own, over the greedy decoded beside it


@pytest.mark.parametrize("graphs, calls", [(True, ["record", 1, 1, 2]), (False, [1, 2])])
def test_with_cuda_graphs_every_graph_is_recorded_and_a_prompt_decoded_untimed_before_the_timed_ones(tmp_path, graphs, calls):
    """A graph recorded on first use would be timed with the prompt that meets it: the draft's rounds
    and pass lengths, not greedy's one-token pass, which the forward's probe records."""
    forward = SimpleNamespace(device=torch.device("cpu"), kind="a forward", graphs=graphs)
    called: list = []
    logged = {0: {"id": 0, "measured_on": f"{baseline.device_name(forward.device)}; a forward", "seconds": 1.0}}  # resumed

    def decode(i: int) -> dict:
        called.append(i)
        return {"seconds": 1.0}

    done = baseline.decode_remaining(3, forward, logged, tmp_path / DONE_LOG, "test", decode, lambda: called.append("record"))

    assert called == calls and sorted(done) == [0, 1, 2]
    assert [json.loads(line)["id"] for line in (tmp_path / DONE_LOG).read_text().splitlines()] == [1, 2]  # each once


def test_baselines_with_every_prompt_logged_claim_no_gpu_and_publish_the_logged_figures(exported, two_prompts, baseline_entries):
    store, verifier, _, _ = exported
    cfg, prompts, full = two_prompts
    provenance, claims = Provenance(config={"run": "killed before publishing"}), []
    plant_done_log(store, "baseline", provenance, [tagged(entry, "greedy", 500.0) for entry in baseline_entries])

    resumed = measure_baselines(cfg, verifier, prompts, store, provenance, claim=lambda: counted_claim(claims))

    assert claims == []
    assert resumed.reference() == full.reference()
    assert resumed.greedy_tokens_per_s == pytest.approx(resumed.num_tokens / 1000.0)
    assert resumed.measured_on == baseline_entries[0]["measured_on"]


def test_a_run_resumed_on_another_device_decodes_the_logged_prompts_again(exported, two_prompts, baseline_entries, caplog):
    store, verifier, _, _ = exported
    cfg, prompts, full = two_prompts
    provenance = Provenance(config={"run": "resumed on another device"})
    plant_done_log(store, "baseline", provenance, [tagged(baseline_entries[0], "greedy", 1000.0, measured_on="NVIDIA H100 80GB HBM3")])

    resumed = measure_baselines(cfg, verifier, prompts, store, provenance)

    assert resumed.reference() == full.reference() and resumed.measured_on.startswith("cpu")
    assert resumed.greedy_tokens_per_s > resumed.num_tokens / 1000.0  # no speed from the other device
    assert "prompts decoded on NVIDIA H100 80GB HBM3 are decoded again on cpu" in caplog.text


def test_a_killed_evaluation_resumes_at_its_first_undecoded_prompt(exported, two_prompts, tmp_path):
    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts
    ids, references = chat_prompts(verifier, read_prompts(prompts, cfg.num_prompts), prompts), baselines.reference()
    first = evaluate_module._decode_prompts(cfg, "cpu", checkpoint, verifier, ids[:1], references[:1], {}, tmp_path / DONE_LOG)[0]
    provenance, claims = Provenance(config={"run": "evaluation killed after one prompt"}), []
    plant_done_log(
        store, "evaluation", provenance, [tagged(tagged(first, "2", 1000.0), "greedy", 500.0)], torn='{"id": 1, "measured_on": "cp'
    )
    full = evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(config={"run": "uninterrupted"}), baselines)

    resumed = evaluate(cfg, checkpoint, verifier, prompts, store, provenance, baselines, claim=lambda: counted_claim(claims))

    assert len(claims) == 1 and resumed.mismatches == 0
    figures = ("method", "k", "tau", "acceptance_by_position", "tokens")
    assert [[r[f] for f in figures] for r in resumed.results] == [[r[f] for f in figures] for r in full.results]
    assert (resumed.draft_token_accuracy, resumed.draft_vocab_coverage) == (full.draft_token_accuracy, full.draft_vocab_coverage)
    assert resumed.counts("eagle3", 4) == full.counts("eagle3", 4)
    [k2] = [r for r in resumed.results if (r["method"], r["k"]) == ("eagle3", 2)]
    assert k2["tokens_per_s"] < k2["tokens"] / 1000.0  # the first prompt's logged decodes were kept
    assert resumed.greedy_tokens_per_s < resumed.num_tokens / 500.0 and k2["greedy_tokens_per_s"] == resumed.greedy_tokens_per_s
    assert sorted(p.name for p in resumed.path.iterdir()) == ["manifest.json", "per_prompt.json", "report.json"]

    claims.clear()
    provenance = Provenance(config={"run": "evaluation killed before publishing"})
    plant_done_log(
        store,
        "evaluation",
        provenance,
        [
            first,
            evaluate_module._decode_prompts(cfg, "cpu", checkpoint, verifier, ids, references, {0: first}, tmp_path / "both.jsonl")[1],
        ],
    )
    assert (
        evaluate(cfg, checkpoint, verifier, prompts, store, provenance, baselines, claim=lambda: counted_claim(claims)).results[0]["tau"]
        == full.results[0]["tau"]
    )
    assert claims == []


def test_an_unfinished_evaluation_reports_the_evaluations_own_figures_over_the_prompts_it_finished(
    exported, two_prompts, tmp_path, monkeypatch
):
    """`bench/unfinished_evaluation.py` reads an evaluation's done log as `evaluate` summarizes it,
    pairing n-gram's decodes of the same prompts from the baselines artifact."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import unfinished_evaluation

    store, verifier, _hidden, checkpoint = exported
    cfg, prompts, baselines = two_prompts
    ids, references = chat_prompts(verifier, read_prompts(prompts, cfg.num_prompts), prompts), baselines.reference()
    log = tmp_path / DONE_LOG
    evaluate_module._decode_prompts(cfg, "cpu", checkpoint, verifier, ids, references, {}, log)
    full = evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(config={"run": "uninterrupted"}), baselines)
    categories = write_jsonl(tmp_path / "categories.jsonl", [{"category": "math"}, {"category": "writing"}])

    both = unfinished_evaluation.summarize(unfinished_evaluation.read_done(log), baselines.path, categories)

    assert both["prompts"] == [0, 1] and both["of_prompts"] == 2 and both["mismatches"] == 0
    assert both["draft_token_accuracy"] == round(full.draft_token_accuracy, 3)
    rows = {(r["method"], r["k"]): r for r in full.results}
    for k, gain in ((g["k"], g) for g in full.gains_over_ngram):
        row = both["by_k"][str(k)]
        assert (row["eagle3"], row["ngram"], row["gain"]) == tuple(
            round(x, 3) for x in (rows["eagle3", k]["tau"], rows["ngram", k]["tau"], gain["gain"])
        )
        assert row["accepted_by_position"] == [round(a, 3) for a in rows["eagle3", k]["acceptance_by_position"]]
        assert row["tokens"] == baselines.num_tokens
        assert list(row["by_category"]) == ["math", "writing"]

    first, second = log.read_text().splitlines(keepends=True)
    measured_on = json.loads(second)["measured_on"]
    stale = json.dumps({**json.loads(second), "measured_on": "another device"}) + "\n"
    log.write_text(stale + second + first[:20])  # the second prompt decoded again on resume; the first's line torn by a kill
    second = unfinished_evaluation.summarize(unfinished_evaluation.read_done(log), baselines.path, None)

    assert second["prompts"] == [1] and second["measured_on"] == [measured_on]
    for k in cfg.ks:
        row = second["by_k"][str(k)]
        assert row["eagle3"] == round(tau_from_counts(full.counts("eagle3", k)[1:]), 3)
        assert row["ngram"] == round(tau_from_counts(baselines.counts("ngram", k)[1:]), 3)
        assert row["eagle3_se"] is None and row["gain_se"] is None  # one prompt: no spread
        assert both["by_k"][str(k)]["by_category"]["writing"][f"eagle3_k{k}"] == row["eagle3"]


def test_a_run_waiting_for_another_run_of_the_step_claims_its_gpu_only_once_it_holds_the_step(exported):
    store, verifier, _hidden, checkpoint = exported
    cfg = EvalConfig(num_prompts=1, max_new_tokens=8, ks=[2])
    prompts = write_jsonl(store.root / "one_prompt.jsonl", [{"prompt": "Count to five."}])
    provenance = Provenance(config={"run": "claimed"})

    baselines = measure_baselines(cfg, verifier, prompts, store, provenance)
    run = run_while_another_run_holds_the_step(
        store,
        EvalManifest,
        provenance,
        lambda claim: evaluate(cfg, checkpoint, verifier, prompts, store, provenance, baselines, claim=claim),
    )

    [claimed] = run.claimed_at
    assert claimed >= run.released_at
    assert run.result.mismatches == 0 and run.result.num_prompts == 1
    assert run.result.seconds <= run.finished_at - run.released_at - CLAIM_WAIT_S


def test_prompt_file_without_a_prompt_field_names_the_record(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"text": "b"}])

    with pytest.raises(ArtifactError, match=r"p\.jsonl: record 1: no prompt field"):
        read_prompts(path, 5)


def test_prompts_are_read_as_regeneration_reads_them(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question": "What is 2 + 2?"},
            {"messages": [{"role": "System", "content": "Be brief."}, {"role": "User", "content": "Hi"}]},
            {"turns": ["First?", "Second?"]},
        ],
    )

    assert read_prompts(path, 5) == ["What is 2 + 2?", "Hi", "First?"]


@pytest.mark.vllm
@pytest.mark.parametrize("served", ["served_draft", "served_two_layer_draft", "served_moe_draft"])
def test_served_counters_give_the_acceptance_our_own_decoding_measures(served, request):
    served_draft = request.getfixturevalue(served)
    store, verifier, checkpoint = served_draft.store, served_draft.verifier, served_draft.checkpoint
    # Prompts the draft was trained on (with the verifier's answers to them): it accepts some tokens.
    prompts = write_jsonl(store.root / "served-prompts.jsonl", [json.loads(line) for line in SAMPLE.read_text().splitlines()[:4]])
    own_cfg = EvalConfig(num_prompts=4, max_new_tokens=48, ks=[3], device="cpu")
    served_cfg = own_cfg.model_copy(
        update={"backend": "vllm", "endpoint": EndpointConfig(base_url=served_draft.base_url, model=served_draft.model)}
    )

    served = evaluate(served_cfg, checkpoint, verifier, prompts, store, Provenance(config={"run": "served"}))
    baselines = measure_baselines(own_cfg, verifier, prompts, store, Provenance(config={"run": "own"}))
    own = evaluate(own_cfg, checkpoint, verifier, prompts, store, Provenance(config={"run": "own"}), baselines)

    [row] = served.results
    [reference] = [r for r in own.results if r["method"] == "eagle3"]
    assert (row["method"], row["k"], row["tokens"]) == ("eagle3", 3, reference["tokens"])
    assert row.keys() == reference.keys() and row["tau_standard_error"] is None  # counters are totals, not per prompt
    assert served.gains_over_ngram is None and own.gains_over_ngram[0]["k"] == 3
    assert served.counts("eagle3", 3) is None and len(own.counts("eagle3", 3)) == 4
    assert row["verifier_passes"] == reference["verifier_passes"]
    # Accepted counts may differ by a token or two over the run (seen: 54 served, 52 ours of 137 passes).
    assert row["acceptance_by_position"] == pytest.approx(reference["acceptance_by_position"], abs=0.02)
    assert row["tau"] == pytest.approx(reference["tau"], abs=0.05) and row["tau"] > 1
    assert served.greedy_tokens_per_s is None and served.mismatches is None
    assert json.loads((served.path / "report.json").read_text())["results"] == served.results


@pytest.mark.vllm
def test_a_model_without_spec_decode_counters_names_the_flag_to_serve_the_draft(served_draft):
    endpoint = EndpointConfig(base_url=served_draft.base_url, model="no-such-model")

    with pytest.raises(EndpointError, match=r"/metrics: no spec-decode counters .* for model 'no-such-model'.*--speculative-config"):
        read_spec_decode_counters(endpoint)

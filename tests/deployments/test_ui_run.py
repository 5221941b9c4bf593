"""The Prefect UI as a person uses it: headless Chromium, driven by Playwright, opens the train-on-demand
deployment on a real `prefect server start`, starts a custom run from the PipelineConfig form with a
changed learning rate, follows the run page while a real process worker runs it, and opens the run's
artifacts. Screenshots of every stage are kept in test-output/ui/."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.browser]

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "ui"
# Without the networking flags headless Chromium stalls on connections it cannot make here.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHANGED_LR = 7e-4
RUN_STATE = ".page-heading-flow-run__meta .state-badge"
FINAL_STATE = re.compile(r"^(Completed|Failed|Crashed|Cancelled)$")


def _submitted_run(deployment_id, timeout_s: float = 60) -> str:
    """The id of the run the form submitted (the one with the changed learning rate). Not read from the
    confirmation toast: it shows for a few seconds, which a loaded machine let pass unseen."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
            ours = [run for run in runs if run.parameters.get("config", {}).get("train", {}).get("lr") == CHANGED_LR]
            if ours:
                [run] = ours
                return str(run.id)
            time.sleep(0.5)
    raise AssertionError(f"no run of deployment {deployment_id} with train.lr={CHANGED_LR} within {timeout_s} s of submitting the form")


def _require(available: bool, reason: str) -> None:
    """Skip where the browser is missing, except under CI, where setup.sh installs it and a skip would hide that."""
    if available:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the UI test must run, not skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium: Playwright cannot download its own browser without internet access."""
    path = shutil.which("chromium")
    _require(path is not None, "no `chromium` on PATH: install Debian's chromium package (setup.sh does, as root)")
    _require(importlib.util.find_spec("playwright") is not None, "playwright is not installed: pip install -e '.[dev]'")
    return path


@pytest.fixture
def page(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)  # 2 cores, shared with the server and a training worker
        yield page
        browser.close()


@pytest.fixture
def screenshot(page, capsys):
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    with capsys.disabled():
        print(f"\nUI screenshots: {SCREENSHOTS}")
    return lambda name: page.screenshot(path=SCREENSHOTS / f"{name}.png")


def _form_property(scope, name: str):
    """The form property of config field `name`, labelled by its pydantic title ("max_seq_len" -> "Max Seq Len")."""
    title = name.replace("_", " ").title()
    return scope.locator(
        "xpath=.//div[contains(@class,'schema-form-property')][./div[contains(@class,'p-label__header')]"
        f"//span[contains(@class,'schema-form-property__label') and "
        f"(normalize-space()='{title}' or normalize-space()='{title} (Optional)')]]"
    )


def _fill_form(scope, values: dict) -> None:
    """Enter `values` field by field, as a person would; an `X | None` field is switched to X first."""
    from playwright.sync_api import expect

    for name, value in values.items():
        prop = _form_property(scope, name)
        body = prop.locator("xpath=./div[contains(@class,'p-label__body')]")
        if isinstance(value, dict):
            _fill_form(prop, value)
            continue
        kind = body.get_by_role("button", name=type(value).__name__, exact=True)  # the form's union switch
        if kind.count():
            kind.click()
        if isinstance(value, list):
            items = body.locator(".schema-form-property-array-item")
            for left in reversed(range(items.count())):
                items.first.locator(".schema-form-property-array-item__control > button").click()  # delete
                expect(items).to_have_count(left)
            for i, item in enumerate(value):
                body.get_by_role("button", name="Add item").click()
                items.nth(i).locator("input").fill(str(item))
        else:
            body.locator("input, textarea").first.fill(str(value))


def _follow_run(page, screenshot, timeout_s: float = 600) -> str:
    """Look at the run page every 10 s until the run's state is final; return that state.

    Between looks the tab rests on about:blank: an open run page redraws its graph without pause, which
    costs headless Chromium about 0.7 of a core in software rendering, taken from the worker's 2 cores.
    """
    url, deadline = page.url, time.monotonic() + timeout_s
    while True:
        page.goto(url)
        page.wait_for_load_state("networkidle")
        state = page.locator(RUN_STATE).inner_text()
        if FINAL_STATE.match(state):
            return state
        if state == "Running":
            screenshot("04-run-running")  # the latest look wins: the graph as far as it got
        assert time.monotonic() < deadline, f"the run is still {state} after {timeout_s:.0f} s"
        page.goto("about:blank")
        time.sleep(10)


def _cell(page, text: str):
    """A table cell showing exactly `text` (artifact tables render strings as markdown, so cells have no name)."""
    return page.get_by_role("cell").filter(has_text=re.compile(f"^{re.escape(text)}$"))


def _leaves(tree: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}"""
    flat = {}
    for name, node in tree.items():
        if isinstance(node, dict):
            flat.update(_leaves(node, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = node
    return flat


def test_a_custom_run_from_the_ui_completes_and_shows_its_artifacts(
    chromium, deployments, prefect_server, page, screenshot, tiny_run_config, start_worker
):
    """`chromium` comes first: without a browser the test skips before the minute-long registration."""
    from playwright.sync_api import expect
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from eagle3.config import TrainConfig
    from eagle3.store.manifests import MANIFEST

    assert TrainConfig().lr != CHANGED_LR
    config = {**tiny_run_config, "train": {**tiny_run_config["train"], "lr": CHANGED_LR}}
    ui = prefect_server.removesuffix("/api")

    page.goto(f"{ui}/deployments/deployment/{deployments['train-on-demand'].id}")
    page.get_by_role("button", name="Run", exact=True).click()
    screenshot("01-deployment-run-menu")
    page.get_by_text("Custom run", exact=True).click()
    _fill_form(page, config)
    _form_property(_form_property(page, "train"), "lr").scroll_into_view_if_needed()
    screenshot("02-custom-run-form")
    page.get_by_role("button", name="Submit").click()
    run_id = _submitted_run(deployments["train-on-demand"].id)
    page.goto(f"{ui}/runs/flow-run/{run_id}")
    expect(page.locator(RUN_STATE)).to_be_visible()
    page.wait_for_load_state("networkidle")
    screenshot("03-run-submitted")

    worker_log = start_worker()
    state = _follow_run(page, screenshot)
    screenshot("05-run-finished")
    assert state == "Completed", worker_log.read_text()[-3000:]

    artifacts_tab = page.locator("[role=tablist]").get_by_text("Artifacts", exact=True)
    artifacts_tab.click()
    cards = {key: page.locator(".artifact-card").filter(has=page.get_by_text(key, exact=True)) for key in ("lineage", "acceptance-length")}
    for card in cards.values():
        expect(card).to_be_visible()
    cards["acceptance-length"].scroll_into_view_if_needed()
    screenshot("06-run-artifacts")
    cards["acceptance-length"].click()
    expect(page.get_by_role("columnheader", name="tau", exact=True)).to_be_visible()
    expect(_cell(page, "eagle3").first).to_be_visible()
    screenshot("07-acceptance-length")
    page.go_back()
    artifacts_tab.click()
    cards["lineage"].click()
    expect(_cell(page, "draft")).to_be_visible()
    screenshot("08-lineage")

    with get_client(sync_client=True) as client:
        parameters = client.read_flow_run(run_id).parameters["config"]
        [lineage] = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=["lineage"]))
        )
    typed = _leaves(config)
    assert {key: _leaves(parameters).get(key) for key in typed} == typed
    [draft] = [row for row in json.loads(lineage.data) if row["kind"] == "draft"]
    assert json.loads((Path(draft["path"]) / MANIFEST).read_text())["config"]["cfg"]["lr"] == CHANGED_LR

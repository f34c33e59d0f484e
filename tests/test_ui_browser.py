"""The run pages a user opens: the link a merge prints, opened in headless Chromium on mergeflow's own server.

Debian's `chromium` and `chromium-driver`, driven through selenium (nothing is downloaded at run
time). The Prefect UI is a single-page app: every check waits, bounded, for a text to appear.
Screenshots go to MERGEFLOW_TEST_SCREENSHOTS (else the test's tmp dir); their paths are printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import Export, clone_export
from prefect_server import seeded_prefect_home
from test_local_server import LINK, REPO, mergeflow, newcomer_env

from mergeflow.ops import local_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
WAIT_S = 90  # a busy 2-core machine renders the SPA slowly; bounded all the same


@pytest.fixture()
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # --disable-3d-apis: the run page's graph is a WebGL canvas, which no check here can read. Without a GPU,
    # Chromium draws it in software (SwiftShader) for as long as the page is open: 20 of this test's ~42 CPU-s
    # and 10 s of its wall time, measured. The screenshots show its panel empty; every text checked is the same.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-3d-apis",
                "--window-size=1600,1400"):
        options.add_argument(arg)
    # Chromium makes its profile's singleton socket in a directory of TMPDIR and leaves it there (one
    # org.chromium.Chromium.* per suite run): a short directory of its own (a socket path is at most 107
    # bytes), removed once the browser has quit.
    scratch = tempfile.mkdtemp(prefix="mergeflow-chromium-")
    service = Service(str(CHROMEDRIVER), env={**os.environ, "TMPDIR": scratch})
    try:
        driver = webdriver.Chrome(options=options, service=service)
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _body(driver: object) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)  # type: ignore[attr-defined]


def wait_for_text(driver: object, *texts: str) -> None:
    """Until every text shows on the page (bounded); the failure says what the page showed instead."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(lambda d: all(t in _body(d) for t in texts))
    except TimeoutException:
        shown = _body(driver)
        raise AssertionError(f"not shown: {[t for t in texts if t not in shown]}; the page showed:\n{shown[:3000]}") from None


def open_tab(driver: object, label: str) -> None:
    """Click the run page's tab named `label` (Logs, Task Runs, Artifacts, ...)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    tab = WebDriverWait(driver, WAIT_S).until(expected_conditions.element_to_be_clickable(
        (By.XPATH, f"//li[contains(@class, 'p-tab') and normalize-space()='{label}']")))
    tab.click()


def click_text(driver: object, key: str) -> None:
    """Click the innermost element whose text is `key` (an artifact's card on the Artifacts tab, "See More")."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT_S).until(expected_conditions.element_to_be_clickable(
        (By.XPATH, f"//*[normalize-space()='{key}' and not(*[normalize-space()='{key}'])]"))).click()


def screenshot(driver: object, directory: Path, name: str) -> Path:
    path = directory / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    print(f"screenshot: {path}")
    return path


def test_printed_links_open_the_run_in_a_browser(tmp_path: Path, pristine_flux_w2: Export, browser: object) -> None:
    shots = Path(os.environ.get("MERGEFLOW_TEST_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    ex = clone_export(pristine_flux_w2, tmp_path)
    home = seeded_prefect_home(tmp_path / "prefect-home")
    env = newcomer_env(home)
    try:
        started = mergeflow(["server", "start"], env)
        assert started.returncode == 0, started.stderr
        status = json.loads(started.stdout.strip().splitlines()[-1])
        merge = mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model",
                           str(ex.base_dir), "--output_format", "transformer", "--target_dir", str(tmp_path / "out")], env)
        assert merge.returncode == 0, merge.stderr
        link = LINK.search(merge.stderr)
        assert link is not None and link.group(2).startswith(status["ui_url"] + "/"), merge.stderr
        name = link.group(1)

        browser.get(link.group(2))  # type: ignore[attr-defined]
        wait_for_text(browser, name, "Completed", "inspect-inputs", "validate-staged", "publish")
        screenshot(browser, shots, "merge-run")
        open_tab(browser, "Task Runs")
        wait_for_text(browser, "write-shard-00000", "write-metadata", "load-rank-00000")
        screenshot(browser, shots, "merge-task-runs")
        open_tab(browser, "Artifacts")
        wait_for_text(browser, *(f"merge-{kind}-ckpt-step1" for kind in ("progress", "manifest", "summary")))
        screenshot(browser, shots, "merge-artifacts")
        click_text(browser, "merge-manifest-ckpt-step1")
        digests = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["files"]
        wait_for_text(browser, "diffusion_pytorch_model.safetensors", digests["diffusion_pytorch_model.safetensors"][:16])
        screenshot(browser, shots, "merge-manifest-table")

        # A tampered artifact: the validate flow fails, and its page says why in one line.
        tampered = tmp_path / "out"
        weights = sorted(tampered.glob("*.safetensors"))[0]
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        code = ("import sys\nfrom mergeflow.flows.progress import flow_run_links\n"
                "from mergeflow.flows.validate import validate_flow\n"
                "with flow_run_links():\n    validate_flow(test_hf_dir=sys.argv[1])\n")
        own = {**env, "PREFECT_API_URL": status["api_url"]}
        failed = subprocess.run([sys.executable, "-c", code, str(tampered)], env=own, cwd=REPO, capture_output=True,
                                text=True, timeout=300)
        assert failed.returncode != 0, failed.stderr
        failed_link = LINK.search(failed.stderr)
        assert failed_link is not None and failed_link.group(1).startswith("validate-"), failed.stderr
        reason = re.search(r"ArtifactInvalidError: (.+)$", failed.stderr, re.M)
        assert reason is not None, failed.stderr
        browser.get(failed_link.group(2))  # type: ignore[attr-defined]
        why = reason.group(1).strip()
        wait_for_text(browser, failed_link.group(1), "Failed", "validate-artifact", f"Failed with ArtifactInvalidError: {why}")
        screenshot(browser, shots, "validate-failed")
        assert "Traceback" not in _body(browser), "the reason sits above a traceback again"  # that is at debug level
        open_tab(browser, "Details")  # the run's state message: the reason on the page itself, not only in the log
        wait_for_text(browser, "State Message", "ArtifactInvalidError")
        click_text(browser, "See More")  # the UI cuts a long state message
        wait_for_text(browser, why)
        screenshot(browser, shots, "validate-failed-details")
    finally:
        local_server.stop_local_server(home)

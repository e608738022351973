"""The final lesson in JupyterLab, as learners use it: a real server on localhost, headless Chromium runs every cell
through the UI (Run All), then the saved notebook is read back. Needs Debian's `chromium` and `playwright`
(`.ci/run` installs both); under IN_TEST=1 the lesson's sizes shrink, as in nbdev_test."""
import json
import os
import shutil
import subprocess
import time
import urllib.request
from uuid import uuid4

import pytest

from conftest import PY, copy_env, free_port, fresh_copy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LESSON = "nbs/10_launch.ipynb"
# Without these, Chromium tries to reach Google's services at start-up; this machine has no such network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def need_browser():
    "Skip where no browser can be had, except in CI, where a missing browser is a failure."
    try: import playwright.sync_api  # noqa: F401
    except ImportError: playwright_ok = False
    else: playwright_ok = True
    if CHROMIUM and playwright_ok: return
    why = "needs Debian's chromium and `pip install playwright` (.ci/run installs both)"
    if os.getenv("CI"): pytest.fail(why)
    pytest.skip(why)


def start_lab(root, port, token):
    "A JupyterLab server on 127.0.0.1:port serving `root`, the app exposed to the page for Run All."
    env = {**copy_env(root), "IN_TEST": "1", "JUPYTER_CONFIG_DIR": str(root / ".jupyter"),
           "JUPYTER_RUNTIME_DIR": str(root / ".jupyter/runtime")}
    cmd = [PY, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1", "--port", str(port),
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--ServerApp.disable_check_xsrf=True"]
    lab = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return lab
        except OSError: time.sleep(0.5)
    lab.kill()
    raise RuntimeError(f"JupyterLab did not start: {lab.stderr.read()[-2000:]}")


def test_final_lesson_runs_all_in_jupyterlab(tmp_path):
    need_browser()
    from playwright.sync_api import sync_playwright
    root = fresh_copy(tmp_path / "distcourse")
    port, token = free_port(), uuid4().hex
    lab = start_lab(root, port, token)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/lab/tree/{LESSON}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session", timeout=120_000)
            page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
                                   " === 'idle'", timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # Done when no cell waits or runs ([*]) and the kernel is idle, twice in a row a second apart.
            done = ("(() => { const w = window.jupyterapp.shell.currentWidget;"
                    " const busy = [...document.querySelectorAll('.jp-InputPrompt')].some(e => e.textContent.includes('*'));"
                    " return !busy && w.sessionContext.session.kernel.status === 'idle'; })()")
            deadline, idle = time.time() + 600, 0
            while idle < 2:
                assert time.time() < deadline, "Run All did not finish in 600 s"
                idle = idle + 1 if page.evaluate(done) else 0
                time.sleep(1)
            widgets = page.locator(".jp-OutputArea-output .jupyter-widgets.widget-hprogress").count()
            page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
            time.sleep(2)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
    nb = json.loads((root / LESSON).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    not_run = [i for i, c in enumerate(code) if c["execution_count"] is None]
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not not_run, f"code cells {not_run} did not run"
    assert not errors, f"{errors[0]['ename']}: {errors[0]['evalue']}"
    assert widgets > 0, "no progress bar rendered as a widget"
    launch_cell = next(c for c in code if "notebook_launcher(train" in "".join(c["source"]))
    text = "".join("".join(o.get("text", "")) for o in launch_cell["outputs"])
    assert "4 process(es), MULTI_CPU" in text, text[-2000:]  # what rank 0 of the 4 processes reported

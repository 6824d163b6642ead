"""The web app in a real browser: Debian's chromium, driven by Playwright (pip; the browser is not
Playwright's own download). Each view loads; a slider moves and the bars change; a run written by
the trainer appears as curves that follow the file while it grows; a `layouts:` sweep's heatmap
shows every run. `ULTRASCALE_SCREENSHOTS=docs python -m pytest tests/test_ui_browser.py` writes the
screenshots of docs/ui.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from cli_helpers import FAST
from ui_server import get, query, serve

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]
SHOTS = os.environ.get("ULTRASCALE_SCREENSHOTS")


def _shot(page, name: str) -> None:
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / f"ui-{name}.png"), full_page=True)


def _sweep(folder: Path) -> list[str]:
    """A sweep of a `layouts:` list collected the way Slurm runs are: two ran, one ran out of
    memory, one has not run. Returns the run names."""
    from ultrascale.planner.sweep import sweep

    spec = {"base": {"model": {"preset": "tiny"}, "parallel": {"dp": 1}, "device": "cpu"},
            "layouts": ["dp=2,mbs=2", "tp=2", "pp=2,mbs=4", "dp=2,zero=1"],
            "mode": "slurm", "out": str(folder)}
    grid_file = folder.parent.parent / "layouts.yaml"
    grid_file.write_text(yaml.safe_dump(spec))
    grid = sweep(grid_file, log=lambda *a: None)
    for run, tps in [(grid.runs[0], 800.0), (grid.runs[2], 300.0)]:
        (folder / run.name).mkdir(parents=True)
        (folder / run.name / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "loss": 1.0, "step_time_s": 0.1, "tokens_per_s": tps, "mfu": None}) + "\n"
            for s in (1, 2)))
    (folder / grid.runs[1].name).mkdir(parents=True)
    (folder / grid.runs[1].name / "slurm-1.out").write_text("torch.OutOfMemoryError: CUDA out "
                                                            "of memory.")
    sweep(grid_file, collect_only=True, log=lambda *a: None)
    return [r.name for r in grid.runs]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser test needs Playwright: pip install -r requirements-test.txt")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"the browser test drives Debian's chromium, and {CHROMIUM} is missing: "
                    "install it with `apt-get install -y chromium` (.ci/run does).")
    root = tmp_path_factory.mktemp("ui")
    run_dir = root / "runs" / "tiny-dp2"
    # A real training run of the tiny model, written while the first views are tested.
    train = subprocess.Popen(
        [sys.executable, "-m", "ultrascale.cli", "train", *FAST, "--set", "parallel.dp=2",
         "--set", "training.steps=8", "--set", "logging.every=1",
         "--set", "data.val_fraction=0.1", "--set", "training.eval_every=4",
         "--set", f"logging.run_dir={run_dir}",
         "--set", f"logging.metrics_file={run_dir / 'metrics.jsonl'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    other = root / "runs" / "other"  # a second run to overlay on the first
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 5.0 - 0.2 * s, "lr": 1e-3 * s, "grad_norm": 1.0, "tokens_per_s": 900.0,
         "mfu": None, **({"eval_loss": 4.5 - 0.2 * s} if s % 4 == 0 else {})}) + "\n"
        for s in range(1, 9)))
    try:
        names = _sweep(root / "sweeps" / "layouts")
        with serve(root / "runs", root / "sweeps") as (base, _), sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                tempfile.mkdtemp(prefix="chromium-profile-"), executable_path=CHROMIUM,
                headless=True, args=FLAGS, viewport={"width": 1300, "height": 900})
            page = browser.new_page()
            page.set_default_timeout(20_000)
            errors, requests = [], []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request", lambda request: requests.append(request.url))
            page.goto(f"{base}/?poll=300#memory")
            page.wait_for_selector("body[data-ready=true]")
            yield {"page": page, "base": base, "train": train, "run_dir": run_dir,
                   "other": other, "sweep": names, "errors": errors, "requests": requests,
                   "browser": browser}
            browser.close()
    finally:
        if train.poll() is None:
            train.kill()
        train.communicate()


def _values(page, selector: str) -> dict[str, float]:
    return page.eval_on_selector_all(
        selector, "els => Object.fromEntries(els.map(e => [e.dataset.name, +e.dataset.value]))")


def test_memory_view_bars_follow_a_slider(app):
    page = app["page"]
    page.wait_for_selector("#memory-bars rect.seg")
    page.wait_for_selector("#memory-knob-chart g.bar rect.seg")
    before = _values(page, "#memory-bars rect.seg")
    assert page.input_value("#slider-zero") == "1"  # ZeRO-1: gradients are not sharded yet
    _shot(page, "memory")
    page.focus("#slider-zero")
    page.keyboard.press("ArrowRight")  # ZeRO-2
    page.wait_for_function("g => +document.querySelector('#memory-bars rect[data-name=gradients]')"
                           ".dataset.value < g", arg=before["gradients"])
    after = _values(page, "#memory-bars rect.seg")
    assert after["gradients"] < before["gradients"] / 4  # sharded over dp=8
    assert after["parameters"] == before["parameters"]
    # The bars are the API's numbers, and the API's are the CLI's (tests/test_ui_api.py).
    _, api = get(f"{app['base']}/api/memory?" + query(
        {"preset": "llama3-8b", "dp": 8, "zero": 2, "gpu": "h100"}))
    assert after["gradients"] == api["grads"] and after["optimizer state"] == api["optimizer"]
    assert page.locator("#memory-knob-chart g.bar").count() == 6  # seq_len 1k..32k
    verdict = page.inner_text("#memory-verdict")
    assert ("does NOT fit" in verdict) == (not api["fits"])
    assert not app["errors"]


def test_layouts_view_ranks_and_explains(app):
    page = app["page"]
    page.click("button[data-view=layouts]")
    page.wait_for_selector("#plan-table tr.first")
    _, api = get(f"{app['base']}/api/plan?" + query(
        {"preset": "llama3-8b", "gpus": 64, "gpu": "h100", "global_batch_tokens": "1M",
         "seq_len": 4096, "dtype": "bf16", "top": 5}))
    rows = page.locator("#plan-table tr")
    assert rows.count() == 1 + len(api["ranked"]) == 6
    assert rows.nth(1).locator("td").nth(1).inner_text().startswith(api["ranked"][0]["layout"])
    assert page.locator("#plan-breakdown g.bar").count() == 5
    assert page.inner_text("#plan-why") == api["why"]
    _shot(page, "layouts")
    assert not app["errors"]


def test_runs_view_draws_a_training_run_and_follows_it(app):
    page, run_dir = app["page"], app["run_dir"]
    out, _ = app["train"].communicate(timeout=300)  # (started by the fixture)
    assert app["train"].returncode == 0, out[-2000:]
    metrics = run_dir / "metrics.jsonl"
    logged = metrics.read_text().splitlines()
    assert len(logged) == 8
    page.click("button[data-view=runs]")
    page.click("#runs-refresh")
    page.wait_for_selector(f"#runs-select option[value='{run_dir}']", state="attached")
    page.select_option("#runs-select", str(run_dir))
    page.wait_for_selector("#run-loss path.line[data-points='8']")
    for chart in ("grad_norm", "throughput", "memory", "comm"):
        assert page.locator(f"#run-{chart} path.line").count() >= 1, chart
    assert "peak rate is not known" in page.text_content("#run-mfu")  # MFU is null on a CPU
    _shot(page, "runs")
    # Two more steps arrive while the page is open: the curve follows (it polls every 0.3 s).
    last = json.loads(logged[-1])
    with open(metrics, "a") as fh:
        for step in (9, 10):
            fh.write(json.dumps({**last, "step": step, "loss": last["loss"] * 0.9}) + "\n")
    page.wait_for_selector("#run-loss path.line[data-points='10']")
    assert not app["errors"]


def test_runs_view_shows_every_run_of_a_layouts_sweep(app):
    page = app["page"]
    page.click("button[data-view=runs]")
    option = page.locator("#runs-select option", has_text="sweep: ")
    page.select_option("#runs-select", option.get_attribute("value"))
    page.wait_for_selector("#sweep-heatmap g.cell")
    shown = page.eval_on_selector_all("#sweep-heatmap g.cell:not(.empty)",
                                      "els => els.flatMap(e => e.dataset.runs.split(' '))")
    assert sorted(shown) == sorted(app["sweep"])  # every run, once
    texts = page.eval_on_selector_all("#sweep-heatmap g.cell:not(.empty) text",
                                      "els => els.map(e => e.textContent)")
    assert "OOM" in texts and "PENDING" in texts and "400" in texts  # 800 tokens/s over dp=2
    assert page.locator("#sweep-heatmap g.cell.empty").count() > 0  # "not in sweep", no failure
    _shot(page, "sweep")
    assert not app["errors"]


def test_the_memory_state_is_in_the_url_and_a_preset_starts_from_its_own_sizes(app):
    """Issue 50, item 6: a size typed for one preset was kept for the next (Mixtral computed with
    Llama's 16 layers, unmentioned); the boxes were blank; nothing was in the URL."""
    page = app["page"]
    page.click("button[data-view=memory]")
    page.click("#memory-sizes >> xpath=.. >> summary")
    page.wait_for_function("document.querySelector('#memory-form [name=num_layers]')"
                           ".placeholder === '32'")  # llama3-8b's own, shown greyed
    page.fill("#memory-form [name=num_layers]", "16")
    page.wait_for_selector("#memory-overrides:has-text('num_layers=16')")
    page.select_option("#memory-preset", "mixtral-8x7b")
    page.wait_for_function("document.querySelector('#memory-form [name=num_experts]')"
                           ".placeholder === '8'")
    assert page.input_value("#memory-form [name=num_layers]") == ""
    assert page.locator("#memory-overrides").count() == 0
    page.focus("#slider-tp")
    page.keyboard.press("ArrowRight")  # tp 2
    page.wait_for_function("location.search.includes('m.tp=2')")
    assert "m.preset=mixtral-8x7b" in page.url and page.url.endswith("#memory")
    page.wait_for_function("document.querySelector('#memory-bars g.bar').dataset.label"
                           ".includes('tp2')")
    verdict = page.inner_text("#memory-verdict")
    again = app["browser"].new_page()  # the same URL shows the same state
    again.goto(page.url)
    again.wait_for_selector("body[data-ready=true]")
    again.wait_for_function("v => document.querySelector('#memory-verdict').innerText === v",
                            arg=verdict)
    assert again.input_value("#memory-preset") == "mixtral-8x7b"
    assert again.inner_text("#slider-tp-value") == "2"
    again.close()
    assert not app["errors"]


def test_a_layout_row_opens_its_memory_and_offers_its_config(app):
    page = app["page"]
    page.click("button[data-view=layouts]")
    page.wait_for_selector("#plan-table tr.first")
    row = page.locator("#plan-table tr").nth(2)  # the runner-up
    layout = row.get_attribute("data-layout")
    href = row.locator("a.config").get_attribute("href")
    row.locator("button.to-memory").click()
    page.wait_for_selector("#view-memory:not([hidden])")
    page.wait_for_function("l => document.querySelector('#memory-bars g.bar')?.dataset.label "
                           "!== undefined && location.search.includes('m.preset=llama3-8b')",
                           arg=layout)
    _, plan_api = get(f"{app['base']}/api/plan?" + query(
        {"preset": "llama3-8b", "gpus": 64, "gpu": "h100", "global_batch_tokens": "1M",
         "seq_len": 4096, "dtype": "bf16", "top": 5}))
    fields = next(r["layout_fields"] for r in plan_api["ranked"] if r["layout"] == layout)
    for name in ("dp", "tp", "pp", "mbs", "grad_accum", "zero"):
        assert page.inner_text(f"#slider-{name}-value") == str(fields[name]), name
    _, mem = get(f"{app['base']}/api/memory?" + query(
        {"preset": "llama3-8b", "gpu": "h100", **{k: fields[k] for k in (
            "dp", "tp", "pp", "cp", "ep", "zero", "mbs", "grad_accum", "seq_len", "recompute",
            "dtype", "pp_schedule", "pp_virtual_stages", "sequence_parallel")}}))
    page.wait_for_function("t => document.querySelector('#memory-verdict').textContent"
                           ".startsWith(t)", arg=page.evaluate("fmtBytes", mem["total"]))
    import urllib.request
    with urllib.request.urlopen(app["base"] + href, timeout=60) as response:
        assert 'filename="plan.yaml"' in response.headers["Content-Disposition"]
        config = yaml.safe_load(response.read())
    assert config["parallel"]["dp"] == fields["dp"] and config["device"] == "cuda"
    assert config["training"]["micro_batch_size"] == fields["mbs"] and "data" in config
    assert not app["errors"]


def test_two_runs_overlay_with_the_validation_loss_and_the_lr(app):
    """Issue 50, item 5: the runs view drew neither eval_loss nor the learning rate, and no view
    put two runs side by side."""
    page, run_dir, other = app["page"], app["run_dir"], app["other"]
    page.click("button[data-view=runs]")
    page.click("#runs-refresh")
    page.wait_for_selector(f"#runs-compare option[value='{other}']", state="attached")
    page.select_option("#runs-select", str(run_dir))
    page.wait_for_selector("#run-loss path.line[data-name='eval loss']")
    page.wait_for_selector("#run-lr path.line[data-name='lr']")
    page.select_option("#runs-compare", str(other))
    page.wait_for_selector("#run-loss path.line[data-name='runs/other: eval loss']")
    names = page.eval_on_selector_all("#run-loss path.line", "els => els.map(e => e.dataset.name)")
    assert sorted(names) == ["runs/other: eval loss", "runs/other: loss",
                             "runs/tiny-dp2: eval loss", "runs/tiny-dp2: loss"], names
    assert page.locator("#run-lr path.line").count() == 2
    assert "r.compare=" in page.url and "r.run=" in page.url
    again = app["browser"].new_page()
    again.goto(page.url)
    again.wait_for_selector("body[data-ready=true]")
    again.wait_for_selector("#run-loss path.line[data-name='runs/other: eval loss']")
    again.close()
    assert not app["errors"]


def test_the_page_asks_nothing_of_any_other_host(app):
    """Offline: every request the views made went to the app itself (assets ship in the
    package; no CDN, no font service)."""
    assert app["requests"] and all(url.startswith(app["base"] + "/") or url.startswith("data:")
                                   for url in app["requests"]), app["requests"]

"""The TensorBoard dashboard (callbacks/layout.py, docs/dashboard.md) against a real ``lnstab fit``: every scalar tag
the run logs is in exactly one chart, no chart mixes kinds of quantity, and a real browser (Debian's chromium, headless)
draws every chart with data.

A chart may hold one *kind* of quantity only. A tag's kind is its name without a trailing site or layer
(``hidden/mean_abs/L01_attn`` → ``hidden/mean_abs``; ``total`` is not a site, so ``grad/norm/total`` is its own kind),
and the few distinct quantities of one unit that are meant to be read against each other form one kind each
(:data:`FAMILIES`: train, val and test loss; a bound and the value it bounds; the R² of the two growth fits; …).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lnstab.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SITE = re.compile(r"/(?:L\d+(?:_\w+)?|embed|final)$")
FAMILIES = (
    {"train/loss", "val/loss", "test/loss"},
    {"val/ppl", "test/ppl"},
    {"throughput/tokens_per_s", "throughput/device/tokens_per_s"},
    {"throughput/device/flops_per_s", "throughput/peak_flops"},
    {"bound/ma_final", "bound/ma_bound"},
    {"bound/var_final", "bound/var_bound"},
    {"growth/linear_r2", "growth/exp_r2"},
    {"eval/ppl_exp_mean_loss", "eval/ppl_mean_seq"},
    {"eval/rouge1", "eval/rouge2", "eval/rougeL", "eval/copy_rate"},  # fractions in [0, 1], read together
    {"eval/bertscore_precision", "eval/bertscore_recall", "eval/bertscore_f1"},
)


def kind(tag: str) -> str:
    """The kind of quantity a tag holds (module docstring)."""
    name = SITE.sub("", tag)
    return next((min(family) for family in FAMILIES if name in family), name)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The quickstart experiment shrunk to 6 steps of a 2-layer GPT, every instrument at a short cadence, with a
    z-loss and a gradient-norm threshold low enough to record divergence events (policy ``continue``), then
    ``lnstab test`` on its last checkpoint: every scalar a run directory can hold."""
    tmp = tmp_path_factory.mktemp("dashboard")
    config = {
        "extends": str(ROOT / "experiments" / "quickstart.yaml"),
        "trainer": {"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 1, "log_every_n_steps": 1,
                    "precision": "32-true", "enable_progress_bar": False, "enable_model_summary": False,
                    "num_sanity_val_steps": 0},
        "checkpoint": {"every_n_train_steps": 3},
        "instruments": {"every_n_steps": 2, "jacobian_every_n_steps": 3, "jacobian_n_iter": 4,
                        "divergence_policy": "continue", "grad_norm_threshold": 1e-3},
        "evaluation": {"n_samples": 2, "batch_size": 2},
        "model": {"preset": "tiny", "vocab_size": 64, "block_size": 16, "warmup_steps": 1, "lr_decay_steps": 40,
                  "z_loss": 1e-4},
        "data": {"init_args": {"source": "synthetic", "batch_size": 4, "num_workers": 0, "val_tokens": 256,
                               "synthetic_tokens": 20_000, "synthetic_vocab_size": 64}},
    }
    path = tmp / "dashboard.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp / "run"
    cli_main(["fit", "--config", str(path), "--run_dir", str(run_dir)])
    cli_main(["test", "--config", str(path), "--run_dir", str(run_dir), "--ckpt_path", "last"])
    return run_dir


def read_run(run_dir: Path) -> tuple[set[str], dict[str, dict[str, list[str]]]]:
    """The scalar tags of a run's event files, and the custom-scalars layout it wrote (category → chart → regexes)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in layout.category}
    return set(events.Tags()["scalars"]), charts


def test_every_scalar_of_a_run_is_in_exactly_one_chart_and_no_chart_mixes_kinds(run):
    tags, layout = read_run(run)
    assert {"train/loss", "val/ppl", "test/loss", "train/z_loss", "divergence/events", "eval/rouge1"} <= tags
    assert "hp_metric" not in tags  # TensorBoardLogger's placeholder, -1 in every run
    assert next(iter(layout)) == "Training"
    where = {tag: [(category, title) for category, charts in layout.items() for title, regexes in charts.items()
                   if any(re.match(regex, tag) for regex in regexes)] for tag in tags}
    assert {tag: charts for tag, charts in where.items() if len(charts) != 1} == {}
    kinds: dict[tuple[str, str], set[str]] = {}
    for tag, charts in where.items():
        kinds.setdefault(charts[0], set()).add(kind(tag))
    assert {chart: found for chart, found in kinds.items() if len(found) > 1} == {}
    assert len(kinds) == sum(len(charts) for charts in layout.values())  # and every chart has a tag of this run


def require_browser() -> None:
    """Skip with the reason where chromium, its driver or selenium is missing; fail under CI, which installs them."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        why = f"the browser check needs {', '.join(missing)} (Debian: apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true" or os.environ.get("LNSTAB_REQUIRE_CHROMIUM"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)


def test_a_missing_browser_is_a_skip_with_its_reason_and_a_failure_under_ci(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("LNSTAB_REQUIRE_CHROMIUM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs .*no-chromium .*apt-get install chromium"):
        require_browser()
    for name, value in (("CI", "true"), ("LNSTAB_REQUIRE_CHROMIUM", "1")):  # CI's convention, and .ci/run's
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(pytest.fail.Exception, match="^CI: the browser check needs .*no-chromium"):
                require_browser()


def start_tensorboard(logdir: Path) -> tuple[subprocess.Popen, str]:
    """TensorBoard on a free loopback port: the process and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0",
         "--load_fast", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    said = []
    while True:  # TensorBoard names its port on stderr; 120 s is a guard for a loaded machine, not a goal
        try:
            said.append(lines.get(timeout=120))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"TensorBoard named no URL in 120 s: {''.join(said)[-2000:]}")
        found = re.search(r"http://127\.0\.0\.1:\d+/", said[-1])
        if found:
            return proc, found.group(0)


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


# Every custom-scalars chart card in the page (they sit in nested shadow roots): its title, the points of each of its
# series, and the line segments and point symbols drawn in its SVG.
CARDS_JS = """
const cards = [];
(function walk(root) {
  for (const el of root.querySelectorAll('*')) {
    if (el.tagName === 'TF-CUSTOM-SCALAR-MULTI-LINE-CHART-CARD') cards.push(el);
    if (el.shadowRoot) walk(el.shadowRoot);
  }
})(document);
return cards.map(card => {
  const series = card._nameToDataSeries || {};
  let lines = 0, symbols = 0;
  (function walk(root) {
    for (const p of root.querySelectorAll('path')) {
      const cls = p.getAttribute('class') || '', d = p.getAttribute('d') || '';
      if (cls.includes('line') && d.includes('L')) lines++;
      if (cls.includes('symbol') && d) symbols++;
    }
    for (const el of root.querySelectorAll('*')) if (el.shadowRoot) walk(el.shadowRoot);
  })(card.shadowRoot || card);
  return {title: card.title, points: Object.values(series).map(s => s.getData().length), lines, symbols};
});
"""


@pytest.mark.system
def test_a_browser_draws_every_chart_of_the_layout_with_data(run, tmp_path):
    """TensorBoard's HTTP API gives every chart's regexes data; headless chromium then draws each chart's lines.
    ``LNSTAB_DASHBOARD_PNG=docs/dashboard.png`` keeps the screenshot (docs/dashboard.md)."""
    require_browser()
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    proc, url = start_tensorboard(run)
    profile = tempfile.mkdtemp(dir=tmp_path)
    driver = None
    try:
        (name,) = get_json(url + "data/runs")
        layout = get_json(url + "data/plugin/custom_scalars/layout")["category"]
        titles = [chart["title"] for category in layout for chart in category["chart"]]
        assert layout[0]["title"] == "Training" and len(titles) == len(set(titles))
        for category in layout:
            for chart in category["chart"]:
                for regex in chart["multiline"]["tag"]:
                    query = urllib.parse.urlencode({"run": name, "tag": regex})
                    answer = get_json(f"{url}data/plugin/custom_scalars/scalars?{query}")
                    assert answer["regex_valid"] and answer["tag_to_events"], (chart["title"], regex)

        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={profile}", "--window-size=1600,1100"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        driver.get(url + "#custom_scalars")

        def drawn(d) -> list[dict] | bool:
            cards = d.execute_script(CARDS_JS)
            done = len(cards) == len(titles) and all(c["points"] and c["lines"] + c["symbols"] for c in cards)
            return cards if done else False

        try:  # the page loads its charts asynchronously; 120 s is a guard for a loaded machine, not a goal
            cards = WebDriverWait(driver, 120, poll_frequency=0.5).until(drawn)
        except TimeoutException:
            cards = driver.execute_script(CARDS_JS)
        assert [c["title"] for c in cards] == titles
        assert [c for c in cards if not (c["points"] and min(c["points"]) > 0 and c["lines"] + c["symbols"])] == []
        assert sum(c["lines"] > 0 for c in cards) == len(cards)  # every chart has a series of 2+ points: a line
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        if os.environ.get("LNSTAB_DASHBOARD_PNG"):
            shutil.copyfile(shot, os.environ["LNSTAB_DASHBOARD_PNG"])
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

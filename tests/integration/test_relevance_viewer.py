"""``python src/relevance.py <run>``: a run's relevance.jsonl as an HTML page and a PNG.

The page is checked as a person would use it, in a real headless Chromium driven over the
DevTools protocol (through a pipe, so no Python package is needed): it loads with no console
error or exception, hovering a token shows its values, and the step and reward filters hide
what they should. That test skips, saying why, where no Chromium is installed
(``apt-get install chromium``; .ci/run installs it for CI).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo.evaluate.viewer import Q_CMAP, Scales, clean, colour, main, render_html

REWARDS = ("format", "exec", "match")


def _record(step: int, j: int) -> dict:
    """A record as mrtpo.lightning.callbacks.samples.relevance_record writes it: 6 tokens, three
    rewards; ``format``'s q stays in [0.007, 0.016] while ``match``'s reaches 0.4."""
    tokens = ["SELECT", " *", " <b>&", "\n", "</script>", '"x"']
    q = {
        "format": [0.007, 0.016, 0.009, 0.008, 0.012, 0.01],
        "exec": [0.05, 0.0, 0.1, 0.02, 0.03, 0.2 - 0.01 * j],
        "match": [0.0, 0.4, 0.01, 0.0, 0.3, 0.1],
    }
    w = {}
    for name, row in q.items():
        mean = sum(row) / len(row)
        w[name] = [round(0.5 + 0.5 * v / mean, 5) for v in row]  # beta 0.5
    return {
        "step": step,
        "id": f"p{j}",
        "beta": 0.5,
        "prompt": "How many singers? <table> & more",
        "tokens": tokens,
        "token_ids": list(range(6)),
        "rewards": {"format": 1.0, "exec": 0.0, "match": None},
        "q": q,
        "w": w,
    }


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "2026-01-01_00-00-00_text2sql-mrtpo"
    folder.mkdir()
    records = [_record(step, j) for step in (1, 11, 21) for j in range(2)]
    (folder / "relevance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _cells(page: str, reward: str, kind: str) -> list[str]:
    """Background colours of one reward's row (first record) on the page."""
    pair = page.split(f'data-reward="{reward}"', 1)[1]
    row = pair.split(f'data-kind="{kind}"', 1)[1].split("</div>", 1)[0]
    return re.findall(r"background:(#[0-9a-f]{6})", row)


def test_one_scale_for_every_row_and_token_text_escaped():
    recs = [_record(1, 0)]
    page = render_html(recs, "run")
    scale = Scales.of(recs)
    assert scale.q_max == pytest.approx(0.4)
    # format's largest q (0.016) is pale on the page's scale, not the darkest colour as it was
    # when each row was scaled by its own maximum
    fmt = _cells(page, "format", "q")
    assert len(fmt) == 6 and fmt[1] == colour(Q_CMAP, 0.016 / 0.4) != colour(Q_CMAP, 1.0)
    assert _cells(page, "match", "q")[1] == colour(Q_CMAP, 1.0)
    # w = 1 (an even share) sits in the middle of its scale
    assert scale.w_pos(1.0) == pytest.approx(0.5)
    # a token is text, never markup: '</script>' cannot end the page's script
    assert page.count("</script>") == 1 and "&lt;/script&gt;" in page and "<b>&" not in page


def test_every_text_from_the_file_stays_text_on_the_page():
    """The page is a template with autoescaping on: a prompt, prompt id, reward name, note or
    title holding markup is shown as that text, in text and in attributes alike, and the
    page's only elements are its own."""
    evil = '<img src=x onerror="alert(1)"> & \'</script>'
    rec = _record(1, 0)
    rec.update(prompt=evil, id=evil, rewards={evil: 1.0}, q={evil: rec["q"]["match"]},
               w={evil: rec["w"]["match"]})  # fmt: skip
    page = render_html([clean(rec)], evil, [evil])
    texts, attrs, tags = [], [], []

    class Read(HTMLParser):
        def handle_starttag(self, tag, a):
            tags.append(tag)
            attrs.extend(v for _, v in a)

        def handle_data(self, data):
            texts.append(data)

    Read(convert_charrefs=True).feed(page)
    assert "img" not in tags and tags.count("script") == 1
    text = "".join(texts)
    # the title, heading, reward filter, note, both diagnostics lines (they name the reward),
    # response head, prompt and reward label
    assert text.count(evil) == 9, text
    assert attrs.count(evil) == 2  # the pair's data-reward and the filter's value


def test_command_writes_page_and_png_and_leaves_the_run_as_it_was(run, capsys):
    before = hashlib.sha256((run / "relevance.jsonl").read_bytes()).hexdigest()
    assert main([str(run)]) == 0
    assert "6 responses" in capsys.readouterr().out
    page = (run / "relevance.html").read_text()
    assert page.count('<section class="rec"') == 6
    assert (run / "relevance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert hashlib.sha256((run / "relevance.jsonl").read_bytes()).hexdigest() == before
    # --steps chooses, --out writes elsewhere
    out = run.parent / "figs"
    assert main([str(run / "relevance.jsonl"), "--steps", "11", "--out", str(out)]) == 0
    assert (out / "relevance.html").read_text().count('data-step="11"') == 2


def test_bad_input_is_named(run, tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 2
    assert "no such run folder" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 2  # a sweep folder: lists the runs below it
    assert run.name in capsys.readouterr().out
    assert main([str(run), "--steps", "5"]) == 2
    assert "no records at step(s) [5]" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    good = json.dumps(_record(1, 0))
    short = json.dumps({**_record(2, 0), "q": {"format": [0.1]}})
    (bad / "relevance.jsonl").write_text(good + "\n" + short + "\n")
    assert main([str(bad)]) == 0  # the record that cannot be drawn is left out, and said so
    assert "line 2: q['format'] does not have one number per token" in capsys.readouterr().out
    # a line cut short (a run killed mid-write) is left out the same way, naming its line
    (bad / "relevance.jsonl").write_text(good + "\n\n" + good[:40] + "\n")
    assert main([str(bad)]) == 0
    assert "relevance.jsonl line 3: not valid JSON" in capsys.readouterr().out
    (bad / "relevance.jsonl").write_text(good[:40] + "\n")
    assert main([str(bad)]) == 2  # nothing left to draw
    assert "relevance.jsonl: no record to draw (1 line," in capsys.readouterr().out


def test_entry_point_runs(run):
    res = subprocess.run(
        [sys.executable, "src/relevance.py", str(run), "--max-steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 of the file's 3 steps are shown" in res.stdout


# ---- a real browser ---------------------------------------------------------------------------
def chromium() -> str | None:
    for name in (os.environ.get("CHROME_PATH"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _high(fd: int) -> int:
    """``fd`` moved to a number of 10 or more (close-on-exec, as os.pipe makes it)."""
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (fds 3 and 4 of the child)."""

    TIMEOUT = 120.0  # a hang guard for one reply, sized for a much slower machine

    def __init__(self, exe: str, profile: Path) -> None:
        # every pipe end above fd 9, so that the child's dup2 onto 3 and 4 never meets one
        to_child, self._w, self._r, from_child = (_high(fd) for fd in (*os.pipe(), *os.pipe()))

        def wire() -> None:
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        args = ["--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(
            [exe, *args],
            preexec_fn=wire,  # only two dup2 calls run there
            close_fds=False,  # fds 3 and 4 stay open; every other pipe end closes on exec
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._r], [], [], self.TIMEOUT)
            chunk = os.read(self._r, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError("Chromium stopped answering")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool | None = None, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session or (session is None and hasattr(self, "session")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str) -> dict:
        for e in self.events:
            if e.get("method") == event:
                return e
        while True:
            e = self._read()
            self.events.append(e)
            if e.get("method") == event:
                return e

    def js(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and errors the browser logged (a failed load)."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(json.dumps(p.get("args")))
            elif m == "Runtime.exceptionThrown":
                out.append(json.dumps(p.get("exceptionDetails")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.call("Browser.close", session=False)
        try:
            self.proc.wait(timeout=self.TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._r)
        os.close(self._w)


def open_page(exe: str, page: Path, profile: Path, width: int = 1280, height: int = 900):
    b = Browser(exe, profile)
    for domain in ("Runtime", "Log", "Page"):
        b.call(f"{domain}.enable")
    b.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
           deviceScaleFactor=1, mobile=False)  # fmt: skip
    b.call("Page.navigate", url=page.resolve().as_uri())
    b.wait_for("Page.loadEventFired")
    return b


def screenshot(b: Browser, path: Path) -> None:
    path.write_bytes(base64.b64decode(b.call("Page.captureScreenshot", format="png")["data"]))


def hover(b: Browser, selector: str) -> None:
    box = b.js(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
        ".getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
    )
    b.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])


def click(b: Browser, selector: str) -> None:
    hover(b, selector)
    box = b.js(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
        ".getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
    )
    for kind in ("mousePressed", "mouseReleased"):
        b.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
               clickCount=1)  # fmt: skip


def test_page_in_headless_chromium(run, tmp_path):
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium here (apt-get install chromium, or set CHROME_PATH)")
    assert main([str(run)]) == 0
    b = open_page(exe, run / "relevance.html", tmp_path / "profile")
    try:
        shown = "document.querySelectorAll('section.rec:not([hidden])').length"
        assert b.js(shown) == 6
        assert b.js("document.getElementById('count').textContent") == "6 of 6 responses"
        # hovering the 2nd token of the first record's format q row shows its values
        hover(b, "section.rec .pair[data-reward='format'] .row[data-kind='q'] .t:nth-child(2)")
        tip = b.js("(() => { const t = document.getElementById('tip'); "
                   "return t.hidden ? null : t.textContent; })()")  # fmt: skip
        assert tip is not None and tip.startswith('format, token 1: " *"'), tip
        assert "q = 0.01600" in tip and "w = " in tip
        screenshot(b, tmp_path / "hover.png")
        # the reward filter, clicked as a person would
        click(b, "input.reward[value='exec']")
        hidden = "document.querySelectorAll(\".pair[data-reward='exec']:not([hidden])\").length"
        assert b.js(hidden) == 0
        assert b.js("document.querySelectorAll('.pair:not([hidden])').length") == 6 * 2
        # the step filter
        b.js("(() => { const s = document.getElementById('step'); s.value = '11'; "
             "s.dispatchEvent(new Event('change')); })()")  # fmt: skip
        assert b.js(shown) == 2
        steps = "[...document.querySelectorAll('section.rec:not([hidden])')]"
        assert b.js(steps + ".map(s => s.dataset.step)") == ["11", "11"]
        assert b.js("document.getElementById('count').textContent") == "2 of 6 responses"
        assert b.errors() == []
    finally:
        b.close()
    assert (tmp_path / "hover.png").read_bytes()[:4] == b"\x89PNG"

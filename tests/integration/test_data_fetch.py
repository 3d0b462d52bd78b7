"""The data command (``python -m mrtpo.data fetch``) against a local HTTP server.

A server on 127.0.0.1 serves files in the layouts their public homes publish (a BIRD-style
dev.zip holding a zip of SQLite databases, a HIR-16K jsonl at the hub's resolve path, the real
RLLA file at its GitHub raw path); the real download, check and extraction code runs, only
the base URL differs (``--mirror``). The fetched files are then read by the task loaders.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mrtpo.fetch.checksums import KNOWN
from mrtpo.fetch.cli import main
from mrtpo.fetch.registry import DATASETS

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
RLLA_PATH = "qiancheng0/ToolRL/8cee13ec0ca72f0461da372a93a6fd8140dbb840/dataset/rlla_4k_raw"
IFEVAL_PATH = "sastpg/HIR/a06c51fc396658aba47d1d58c22e2dfd750d882c/evaluation/IFEval/data"


class Server:
    """Serves ``files`` (path after the first '/', query included); a path in ``truncate``
    announces its full length but sends half and closes; one in ``no_length`` announces no
    length (the body ends when the connection closes)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.truncate: set[str] = set()
        self.no_length: set[str] = set()
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                key = self.path.lstrip("/")
                outer.requests.append(key)
                body = outer.files.get(key)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                if key not in outer.no_length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if key in outer.truncate else body)
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def mirrors(self, *hosts: str) -> list[str]:
        return [a for h in hosts for a in ("--mirror", f"{h}={self.url}")]


@pytest.fixture
def server():
    s = Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _zip(members: dict[str, bytes], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            zf.writestr(info, "/etc/passwd")
    return buf.getvalue()


def _sqlite(tmp: Path) -> bytes:
    db = tmp / "made.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE kite (id INTEGER, colour TEXT)")
    con.executemany("INSERT INTO kite VALUES (?, ?)", [(1, "red"), (2, "blue")])
    con.commit()
    con.close()
    return db.read_bytes()


def _bird_zip(tmp: Path) -> bytes:
    """dev.zip as BIRD publishes it: a top folder with dev.json and a nested dev_databases.zip."""
    rows = [
        {
            "question_id": 0,
            "db_id": "kites",
            "question": "How many kites are there?",
            "evidence": "",
            "SQL": "SELECT count(*) FROM kite",
            "difficulty": "simple",
        }
    ]
    inner = _zip({"dev_databases/kites/kites.sqlite": _sqlite(tmp), "__MACOSX/._kites": b"x"})
    return _zip(
        {
            "dev_20240627/dev.json": json.dumps(rows).encode(),
            "dev_20240627/dev_databases.zip": inner,
            "dev_20240627/README.txt": b"not laid out",
        }
    )


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".part" in p.name)


def test_archive_is_refused_without_a_checksum_then_laid_out_and_read_by_the_loader(
    server, tmp_path, capsys
):
    from mrtpo.tasks.text2sql.data import SplitConfig, find_database, read_questions

    server.files["dev.zip"] = _bird_zip(tmp_path)
    to = tmp_path / "data"
    assert main(["fetch", "bird_dev", "--to", str(to), *server.mirrors("bird")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checksum is committed" in err[0], err
    assert "--trust-first-download" in err[0] and not (to / "bird").exists()
    assert server.requests == []  # refused before anything was downloaded

    args = ["fetch", "bird_dev", "--to", str(to), "--trust-first-download", *server.mirrors("bird")]
    assert main(args) == 0, capsys.readouterr().err
    cfg = SplitConfig.from_mapping(
        "bird_dev",
        {"file": str(to / "bird/dev/dev.json"), "db_dir": [str(to / "bird/dev/dev_databases")]}
        | {"format": "bird"},
    )
    (q,) = read_questions(cfg)
    db = find_database(cfg.db_dir, q.db_id)
    assert db is not None and sqlite3.connect(db).execute(q.query).fetchone() == (2,)
    assert not (to / "bird/dev/README.txt").exists() and not (to / "__MACOSX").exists()
    assert _leftovers(to) == [] and not list(to.glob(".*zip*"))
    rec = json.loads((to / "FETCHED.json").read_text())["archives"]["dev.zip"]
    assert rec["checksum"] == "pinned" and len(rec["sha256"]) == 64

    # pinned: a later fetch keeps it; other bytes at the same address are refused
    capsys.readouterr()
    assert main(["fetch", "bird_dev", "--to", str(to), *server.mirrors("bird")]) == 0
    assert "1 already present" in capsys.readouterr().out and len(server.requests) == 1
    (to / "bird/dev/dev.json").unlink()
    server.files["dev.zip"] = _zip({"dev/dev.json": b"[]"})
    assert main(["fetch", "bird_dev", "--to", str(to), *server.mirrors("bird")]) == 1
    assert "checksum mismatch" in capsys.readouterr().err


def test_hub_file_lands_where_the_instruction_task_reads_it(server, tmp_path, capsys):
    from mrtpo.tasks.instructions.data import load_hir

    rows = [
        {
            "id": 1,
            "source": "type1",
            "prompt": "Write a note.",
            "criteria": ["Do not use any commas"],
            "ground_truth": {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
        },
        {
            "id": 2,
            "source": "type3",
            "prompt": "A MulDimIF-style row.",
            "criteria": ["At most 50 words."],
            "ground_truth": {"constraints": [["Length", "Words", "At most 50 words."]]},
        },
    ]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    server.files["datasets/sastpg/HIR-16K/resolve/main/HIR_trainv1.jsonl"] = body
    to = tmp_path / "data"
    args = ["fetch", "hir16k", "--to", str(to), "--trust-first-download", *server.mirrors("hub")]
    assert main(args) == 0, capsys.readouterr().err
    records, skipped = load_hir(to / "HIR-16K/HIR_trainv1.jsonl", ["ifeval", "ifbench"])
    assert [r.uid for r in records] == ["hir-1"] and sum(skipped.values()) == 1


def test_checksum_mismatch_and_truncation_are_refused_and_removed(server, tmp_path, capsys):
    to = tmp_path / "data"
    key = f"{IFEVAL_PATH}/input_data.jsonl"
    size = next(k[1] for k in KNOWN if k[0] == "ifeval/input_data.jsonl")
    server.files[key] = b"x" * size  # the published size, other bytes
    assert main(["fetch", "ifeval", "--to", str(to), *server.mirrors("github")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checksum mismatch" in err[0], err
    assert not (to / "ifeval/input_data.jsonl").exists() and _leftovers(to) == []

    # a file with no committed checksum: only the announced length can catch the cut
    real = "records/5205322/files/spider-realistic.json?download=1"
    server.files[real] = json.dumps([{"db_id": "x", "query": "SELECT 1", "question": "?"}]).encode()
    server.truncate.add(real)
    args = ["fetch", "spider_realistic", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("zenodo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated download" in err[0], err
    assert not (to / "spider_realistic/spider-realistic.json").exists() and _leftovers(to) == []
    assert not (to / "FETCHED.json").exists()  # nothing was pinned


def test_unsafe_archives_are_refused_and_nothing_lands_outside(server, tmp_path, capsys):
    path = "download?id=1403EGqzIDoHMdQF4c9Bkyl7dZLZ5Wt6J&export=download&confirm=t"
    to = tmp_path / "data"
    args = ["fetch", "spider_test", "--to", str(to), "--trust-first-download"]
    for bad, why in [
        (_zip({"spider_data/test.json": b"[]", "../escaped.json": b"x"}), "unsafe member name"),
        (_zip({"/abs/test.json": b"[]"}), "unsafe member name"),
        (_zip({"spider_data/test.json": b"[]"}, symlink="spider_data/test_database/l"), "symlink"),
    ]:
        server.files[path] = bad
        assert main([*args, *server.mirrors("gdrive")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
        assert not (to / "spider").exists() and not (tmp_path / "escaped.json").exists()
        assert _leftovers(to) == [] and not list(to.glob(".*download"))


@pytest.mark.skipif(not (SHARED / "toolrl_rlla").is_dir(), reason="shared/data is absent")
def test_committed_checksum_accepts_the_published_file_and_check_reports(server, tmp_path, capsys):
    from mrtpo.tasks.toolcall.parsing import load_rlla

    server.files[f"{RLLA_PATH}/rlla_sft.json"] = (SHARED / "toolrl_rlla/rlla_sft.json").read_bytes()
    server.files[f"{IFEVAL_PATH}/input_data.jsonl"] = (
        SHARED / "ifeval/input_data.jsonl"
    ).read_bytes()
    to = tmp_path / "data"
    args = ["fetch", "toolrl_rlla", "ifeval", "--to", str(to), *server.mirrors("github")]
    assert main(args) == 0, capsys.readouterr().err
    assert len(load_rlla(to / "toolrl_rlla/rlla_sft.json")) == 400
    rec = json.loads((to / "FETCHED.json").read_text())["files"]
    assert rec["ifeval/input_data.jsonl"]["checksum"] == "committed"

    capsys.readouterr()
    assert main(["fetch", "--check", str(to), "toolrl_rlla", "ifeval", "ifbench"]) == 1
    out = capsys.readouterr().out
    assert "toolrl_rlla: 1 present" in out and "ifeval: 1 present" in out
    assert "missing: ifbench/IFBench_test.jsonl" in out
    assert main(["fetch", "--check", str(to)]) == 0  # all: what is there is right
    out = capsys.readouterr().out
    assert "ifbench: not fetched" in out and "bird_dev: not fetched" in out
    assert "ifeval: 1 present" in out
    with open(to / "ifeval/input_data.jsonl", "r+b") as f:  # same size, other bytes
        f.write(b"X")
    assert main(["fetch", "--check", str(to), "ifeval"]) == 1
    assert "wrong: ifeval/input_data.jsonl" in capsys.readouterr().out
    # a wrong file is not ours to overwrite: refused naming it, replaced with --replace
    capsys.readouterr()
    assert main(["fetch", "ifeval", "--to", str(to), *server.mirrors("github")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ifeval/input_data.jsonl" in err[0] and "--replace" in err[0], err
    args = ["fetch", "ifeval", "--to", str(to), "--replace", *server.mirrors("github")]
    assert main(args) == 0
    assert main(["fetch", "--check", str(to), "ifeval"]) == 0
    served = len(server.requests)  # a right file is not fetched again
    assert main(["fetch", "ifeval", "--to", str(to), *server.mirrors("github")]) == 0
    assert len(server.requests) == served and "1 already present" in capsys.readouterr().out


@pytest.mark.skipif(not (SHARED / "MANIFEST.csv").is_file(), reason="shared/data is absent")
def test_committed_checksums_agree_with_the_shared_data(capsys):
    with open(SHARED / "MANIFEST.csv", encoding="utf-8") as f:
        manifest = {r["file"]: r for r in csv.DictReader(f)}
    registry = {f.target: f for d in DATASETS.values() for f in d.files}
    for target, size, sha, repo, commit, path in KNOWN:
        row = manifest[target]
        assert (row["sha256"], int(row["bytes"])) == (sha, size), target
        assert (row["source_repo"], row["source_commit"], row["source_path"]) == (
            repo,
            commit,
            path,
        )
        assert registry[target].sha256 == sha
    derived = {f for f, r in manifest.items() if "converted" in r["source_path"]}
    assert set(manifest) - derived == {k[0] for k in KNOWN}
    names = ["spider", "spider_syn", "spider_dk", "toolrl_rlla", "ifeval", "ifbench", "muldimif"]
    assert main(["fetch", "--check", str(SHARED), *names]) == 0, capsys.readouterr().out


def test_command_line_starts_without_torch_and_refuses_bad_input_in_one_line(tmp_path):
    env_cmd = [sys.executable, "-X", "importtime", "-m", "mrtpo.data"]
    run = subprocess.run([*env_cmd, "list"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "bird_dev" in run.stdout, run.stderr[-2000:]
    assert " torch" not in run.stderr and "lightning" not in run.stderr
    for argv, words in [
        (["fetch", "spidr", "--to", str(tmp_path)], "unknown data set 'spidr'"),
        (["fetch", "ifeval"], "fetch needs --to DIR"),
        (["fetch", "--check", str(tmp_path / "nowhere")], "no such folder"),
        (["fetch", "ifeval", "--to", str(tmp_path), "--mirror", "github"], "HOST=http"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "mrtpo.data", *argv], capture_output=True, text=True, timeout=120
        )
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and words in lines[0], run.stderr
    file = tmp_path / "a_file"
    file.write_text("mine")
    run = subprocess.run(
        [sys.executable, "-m", "mrtpo.data", "fetch", "ifeval", "--to", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "is a file" in run.stderr and file.read_text() == "mine"


def test_first_download_of_an_error_page_is_not_pinned(server, tmp_path, capsys):
    """With no committed checksum, a page in place of the data (a quota or login page served
    with 200) must not be accepted and pinned: the file's format is checked first."""
    to = tmp_path / "data"
    page = b"<!DOCTYPE html><html><body>Quota exceeded</body></html>"
    server.files["datasets/sastpg/HIR-16K/resolve/main/HIR_trainv1.jsonl"] = page
    server.files["records/5205322/files/spider-realistic.json?download=1"] = page
    rlla = "qiancheng0/ToolRL/8cee13ec0ca72f0461da372a93a6fd8140dbb840/dataset/rlla_4k"
    server.files[f"{rlla}/train.parquet"] = page
    server.files[f"{rlla}/test.parquet"] = page
    names = ["hir16k", "spider_realistic", "toolrl_rlla_4k"]
    args = ["fetch", *names, "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("hub", "zenodo", "github")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all("not a " in line for line in err), err
    assert not (to / "FETCHED.json").exists()
    assert sorted(p.name for p in to.rglob("*") if p.is_file()) == []


def test_base_urls_move_by_flag_then_environment(monkeypatch):
    from mrtpo.fetch.registry import base_url

    monkeypatch.delenv("MRTPO_FETCH_HUB", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/hf/")
    assert base_url("hub") == "http://127.0.0.1:9/hf"
    monkeypatch.setenv("MRTPO_FETCH_HUB", "http://127.0.0.1:8")
    assert base_url("hub") == "http://127.0.0.1:8"
    assert base_url("hub", {"hub": "http://127.0.0.1:7/"}) == "http://127.0.0.1:7"
    monkeypatch.delenv("MRTPO_FETCH_GITHUB", raising=False)
    assert base_url("github") == "https://raw.githubusercontent.com"


@pytest.mark.skipif(not (SHARED / "MANIFEST.csv").is_file(), reason="shared/data is absent")
def test_readme_data_commands_run_as_written(server, tmp_path, capsys, monkeypatch):
    """The README's "Getting the data" commands, with data/ in a temp folder and the GitHub
    host served from the shared files at their published paths; then the text2sql task's
    composed config reads what landed."""
    import re
    import shlex

    from mrtpo.run.config import compose

    for target, _size, _sha, repo, commit, path in KNOWN:
        server.files[f"{repo}/{commit}/{path}"] = (SHARED / target).read_bytes()
    monkeypatch.setenv("MRTPO_FETCH_GITHUB", server.url)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n### Getting the data\n") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    data = tmp_path / "data"
    lines = [re.sub(r"(?<![\w/])data(?=/|$)", str(data), line) for line in lines if line]
    data_cmds = [shlex.split(line) for line in lines]
    assert [c[:3] for c in data_cmds[:2]] == [["python", "-m", "mrtpo.data"]] * 2
    for cmd in data_cmds[:2]:
        assert main(cmd[3:]) == 0, capsys.readouterr()
    train = data_cmds[2]
    assert train[:2] == ["python", "src/train.py"] and train[-1] == f"paths.data_dir={data}"
    cfg = compose("train.yaml", train[2:])
    assert Path(cfg.task.splits.spider_dev.file) == data / "spider/dev.json"
    assert (data / "spider/database/concert_singer/concert_singer.sqlite").is_file()


def test_archive_without_the_expected_layout_is_refused_and_removed(server, tmp_path, capsys):
    path = "download?id=1403EGqzIDoHMdQF4c9Bkyl7dZLZ5Wt6J&export=download&confirm=t"
    server.files[path] = _zip({"spider_data/test.json": b"[]", "spider_data/README": b"x"})
    to = tmp_path / "data"
    args = ["fetch", "spider_test", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("gdrive")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not hold spider/test_database" in err[0], err
    assert not (to / "spider/test.json").exists() and not (to / "FETCHED.json").exists()


GDRIVE = "download?id=1403EGqzIDoHMdQF4c9Bkyl7dZLZ5Wt6J&export=download&confirm=t"
REALISTIC = "records/5205322/files/spider-realistic.json?download=1"


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_refused_archive_never_removes_or_overwrites_the_users_files(server, tmp_path, capsys):
    to = tmp_path / "data"
    mine = to / "spider/test.json"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"mine")
    args = ["fetch", "spider_test", "--to", str(to), "--trust-first-download"]
    # the archive holds test.json but not the databases: refused, with or without --replace
    server.files[GDRIVE] = _zip({"spider_data/test.json": b"[]"})
    for extra in ([], ["--replace"]):
        assert main([*args, *extra, *server.mirrors("gdrive")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "did not hold spider/test_database" in err[0], err
        assert mine.read_bytes() == b"mine" and _everything(to) == ["spider", "spider/test.json"]
    # a whole archive whose test.json differs: refused naming the file, nothing laid out
    good = {"spider_data/test.json": b"[]", "spider_data/test_database/a/a.sqlite": b"db"}
    server.files[GDRIVE] = _zip(good)
    assert main([*args, *server.mirrors("gdrive")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(mine) in err[0] and "--replace" in err[0], err
    assert mine.read_bytes() == b"mine" and _everything(to) == ["spider", "spider/test.json"]
    # the same content as the archive's is kept as it is; --replace lays out the archive
    assert main([*args, "--replace", *server.mirrors("gdrive")]) == 0, capsys.readouterr().err
    assert mine.read_bytes() == b"[]" and (to / "spider/test_database/a/a.sqlite").is_file()
    assert not list(to.glob(".staging-*")) and _leftovers(to) == []


def test_a_refused_single_file_never_overwrites_the_users_file(server, tmp_path, capsys):
    to = tmp_path / "data"
    mine = to / "spider_realistic/spider-realistic.json"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"[1]")
    server.files[REALISTIC] = json.dumps([{"db_id": "x", "query": "SELECT 1"}]).encode()
    args = ["fetch", "spider_realistic", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("zenodo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(mine) in err[0] and "--replace" in err[0], err
    assert mine.read_bytes() == b"[1]" and server.requests == []
    server.truncate.add(REALISTIC)  # with --replace, a refused download keeps the old file
    assert main([*args, "--replace", *server.mirrors("zenodo")]) == 1
    assert "truncated download" in capsys.readouterr().err and mine.read_bytes() == b"[1]"
    assert _leftovers(to) == []
    server.truncate.clear()
    assert main([*args, "--replace", *server.mirrors("zenodo")]) == 0
    assert mine.read_bytes() == server.files[REALISTIC]


def test_a_zip_bomb_is_refused_in_one_line_and_nothing_is_left(server, tmp_path, capsys):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("spider_data/test.json", b"[]")
        zf.writestr("spider_data/test_database/big/big.sqlite", bytes(40 << 20))
    server.files[GDRIVE] = buf.getvalue()
    assert len(server.files[GDRIVE]) < 100_000
    to = tmp_path / "data"
    args = ["fetch", "spider_test", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("gdrive")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "big.sqlite" in err[0] and "zip bomb" in err[0], err
    assert _everything(to) == []


def _limited(monkeypatch, name: str, max_bytes: int) -> None:
    from dataclasses import replace

    d = DATASETS[name]
    files = tuple(replace(f, max_bytes=max_bytes) for f in d.files)
    archives = tuple(replace(a, max_bytes=max_bytes) for a in d.archives)
    monkeypatch.setitem(DATASETS, name, replace(d, files=files, archives=archives))


def test_downloads_and_archives_past_max_bytes_are_refused(server, tmp_path, capsys, monkeypatch):
    to = tmp_path / "data"
    server.files[REALISTIC] = json.dumps([{"q": "x" * 5000}]).encode()
    _limited(monkeypatch, "spider_realistic", 4000)
    args = ["fetch", "spider_realistic", "--to", str(to), "--trust-first-download"]
    for announced in (True, False):
        if not announced:
            server.no_length.add(REALISTIC)
        assert main([*args, *server.mirrors("zenodo")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "more than 4000 bytes" in err[0], err
        assert _everything(to) == []
    # an archive small enough to download whose members would unpack past the limit
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("spider_data/test.json", b"[]")
        zf.writestr("spider_data/test_database/a/a.sqlite", bytes(20_000))  # too small a bomb
    server.files[GDRIVE] = buf.getvalue()
    assert len(server.files[GDRIVE]) < 1000
    _limited(monkeypatch, "spider_test", 10_000)
    args = ["fetch", "spider_test", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("gdrive")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than 10000 bytes" in err[0], err
    assert _everything(to) == []


def test_links_inside_the_layout_are_not_written_through(server, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    to = tmp_path / "data"
    to.mkdir()
    (to / "spider").symlink_to(elsewhere)
    (to / "spider_realistic").symlink_to(elsewhere)
    server.files[GDRIVE] = _zip(
        {"spider_data/test.json": b"[]", "spider_data/test_database/a/a.sqlite": b"db"}
    )
    server.files[REALISTIC] = json.dumps([{"db_id": "x"}]).encode()
    args = ["fetch", "spider_test", "spider_realistic", "--to", str(to), "--trust-first-download"]
    assert main([*args, *server.mirrors("gdrive", "zenodo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("symbolic link" in line for line in err), err
    assert str(to / "spider") in err[0] and str(to / "spider_realistic") in err[1], err
    assert list(elsewhere.iterdir()) == [] and not list(to.glob(".staging-*"))

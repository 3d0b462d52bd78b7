"""What ``python -m mrtpo.data fetch`` can get: data set name -> published files, their
hashes, and where each goes under ``paths.data_dir`` (docs/data.md: mirrors, unknown checksums,
``max_bytes``: a generous guess above the published size, against a runaway server or zip bomb).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mrtpo.fetch.checksums import KNOWN

GiB = 1 << 30

#: host -> default base URL
HOSTS = {
    "github": "https://raw.githubusercontent.com",
    "hub": "https://huggingface.co",
    "gdrive": "https://drive.usercontent.google.com",
    "bird": "https://bird-bench.oss-cn-beijing.aliyuncs.com",
    "zenodo": "https://zenodo.org",
}


@dataclass(frozen=True)
class Remote:
    """One published file that is stored as it is, at ``target`` under the data folder."""

    target: str
    host: str
    path: str  # under the host's base URL
    sha256: str | None = None  # None: never downloaded by the project
    size: int | None = None
    max_bytes: int = GiB  # the most a download may bring (the largest known file is ~0.1 GB)


@dataclass(frozen=True)
class Archive:
    """A published zip whose members are laid out by ``rules`` (regex on the member name ->
    target template); a member matching ``nested`` is itself a zip laid out by ``inner``."""

    name: str
    host: str
    path: str
    rules: tuple[tuple[str, str], ...]
    expect: tuple[str, ...]  # targets that must exist afterwards (files or folders)
    nested: str | None = None
    inner: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None
    size: int | None = None
    max_bytes: int = 4 * GiB  # the most the download, and separately its unpacked files, may be


@dataclass(frozen=True)
class DataSet:
    name: str
    what: str
    files: tuple[Remote, ...] = ()
    archives: tuple[Archive, ...] = ()
    needs: tuple[str, ...] = field(default=())  # other data sets its config also reads


def base_url(host: str, mirrors: dict[str, str] | None = None) -> str:
    """The base URL of ``host``: ``mirrors``, then the environment, then the public home."""
    if mirrors and host in mirrors:
        return mirrors[host].rstrip("/")
    env = os.environ.get(f"MRTPO_FETCH_{host.upper()}")
    if not env and host == "hub":
        env = os.environ.get("HF_ENDPOINT")
    return (env or HOSTS[host]).rstrip("/")


def _github(prefix: str) -> tuple[Remote, ...]:
    """The committed files whose target starts with ``prefix``."""
    return tuple(
        Remote(target, "github", f"{repo}/{commit}/{path}", sha, size)
        for target, size, sha, repo, commit, path in KNOWN
        if target.startswith(prefix)
    )


_TOOLRL = "qiancheng0/ToolRL/8cee13ec0ca72f0461da372a93a6fd8140dbb840/dataset/rlla_4k"
_TOP = r"^(?:[^/]+/)?"  # an archive's optional top folder

_SETS = (
    DataSet(
        "spider",
        "Spider dev.json, tables.json, 163 databases (wta_1 is not in the pinned copy) and the "
        "training questions as the text2sql task reads them (Spider-Syn's train_spider.json)",
        files=_github("spider/") + _github("spider_syn/train_spider.json"),
    ),
    DataSet(
        "spider_test",
        "Spider's test.json, test_tables.json and test_database/ from the official "
        "spider_data.zip (Google Drive)",
        archives=(
            Archive(
                "spider_data.zip",
                "gdrive",
                "download?id=1403EGqzIDoHMdQF4c9Bkyl7dZLZ5Wt6J&export=download&confirm=t",
                rules=(
                    (_TOP + r"(test\.json|test_tables\.json)$", r"spider/\1"),
                    (_TOP + r"test_database/(.+)$", r"spider/test_database/\1"),
                ),
                expect=("spider/test.json", "spider/test_database"),
                max_bytes=4 * GiB,  # spider_data.zip unpacks to about 1 GB
            ),
        ),
        needs=("spider",),
    ),
    DataSet(
        "spider_syn", "Spider-Syn train and dev", files=_github("spider_syn/"), needs=("spider",)
    ),
    DataSet(
        "spider_dk",
        "Spider-DK questions, tables.json and its 3 extra databases",
        files=_github("spider_dk/"),
        needs=("spider",),
    ),
    DataSet(
        "spider_realistic",
        "Spider-Realistic (Zenodo record 5205322)",
        files=(
            Remote(
                "spider_realistic/spider-realistic.json",
                "zenodo",
                "records/5205322/files/spider-realistic.json?download=1",
            ),
        ),
        needs=("spider",),
    ),
    DataSet(
        "bird_dev",
        "BIRD dev: dev.json and dev_databases/ from the official dev.zip",
        archives=(
            Archive(
                "dev.zip",
                "bird",
                "dev.zip",
                rules=(
                    (_TOP + r"(dev\.json|dev_tables\.json|dev\.sql)$", r"bird/dev/\1"),
                    (_TOP + r"dev_databases/(.+)$", r"bird/dev/dev_databases/\1"),
                ),
                nested=_TOP + r"dev_databases\.zip$",
                inner=((_TOP + r"(?:dev_databases/)?([^/]+/.+)$", r"bird/dev/dev_databases/\1"),),
                expect=("bird/dev/dev.json", "bird/dev/dev_databases"),
                max_bytes=10 * GiB,  # about 3 GB unpacked, plus the nested zip while unpacking
            ),
        ),
    ),
    DataSet(
        "hir16k",
        "HIR-16K as released (HIR_trainv1.jsonl of the hub dataset sastpg/HIR-16K; the task "
        "keeps its first two subsets, task.data.subsets)",
        files=(
            Remote(
                "HIR-16K/HIR_trainv1.jsonl",
                "hub",
                "datasets/sastpg/HIR-16K/resolve/main/HIR_trainv1.jsonl",
            ),
        ),
    ),
    DataSet(
        "toolrl_rlla",
        "ToolRL's RLLA examples, rlla_sft.json (the toolcall task's train file)",
        files=_github("toolrl_rlla/"),
    ),
    DataSet(
        "toolrl_rlla_4k",
        "ToolRL's rlla_4k RL split as published (train/test parquet; point task.data_files at them)",
        files=(
            Remote("toolrl_rlla/rlla_4k/train.parquet", "github", f"{_TOOLRL}/train.parquet"),
            Remote("toolrl_rlla/rlla_4k/test.parquet", "github", f"{_TOOLRL}/test.parquet"),
        ),
    ),
    DataSet("ifeval", "IFEval's input_data.jsonl", files=_github("ifeval/")),
    DataSet("ifbench", "IFBench's IFBench_test.jsonl", files=_github("ifbench/")),
    DataSet("muldimif", "MulDimIF's test.json", files=_github("muldimif/")),
)

#: name -> data set
DATASETS: dict[str, DataSet] = {d.name: d for d in _SETS}

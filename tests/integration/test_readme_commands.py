"""Every command of the README's "Using it" section, read from the README itself, so that the
README and this list cannot drift apart.

Hydra commands (src/train.py, src/eval.py, src/export.py) are composed as their entry points
compose them, every job of a ``-m`` sweep separately (what ``--cfg job`` shows), and a training
config is then checked as far as it can be without loading anything: its typed settings, its
method, and its trainer as on one node of 8 GPUs (the batch divided over them). ``--help`` and
src/relevance.py run for real; ``slow`` runs the commands a CPU can run on the tiny model.
Placeholders such as ``<run>`` become paths in the test's folder.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from tests.conftest import CONFIG_DIR, ROOT

import mrtpo.evaluate.cli  # noqa: F401  (eval.yaml's resolvers, as src/eval.py registers them)
from mrtpo.run.checks import validate
from mrtpo.run.config import compose
from mrtpo.run.config_keys import check_overrides
from mrtpo.run.placement import check_placement
from mrtpo.run.settings import resolve_batch

README = ROOT / "README.md"
HYDRA = {"src/train.py": "train.yaml", "src/eval.py": "eval.yaml", "src/export.py": "export.yaml"}
SLURM = "hydra/launcher=submitit_slurm"


def readme_commands(heading: str = "## Using it") -> list[str]:
    """The command lines of every ```bash block in ``heading``'s section of the README."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else None]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


COMMANDS = readme_commands()


def test_the_section_has_the_commands_it_promises():
    scripts = {shlex.split(c, comments=True)[1] for c in COMMANDS}
    assert {"src/train.py", "src/eval.py", "src/export.py", "src/report.py", "src/table.py"} <= (
        scripts
    )
    assert "src/relevance.py" in scripts
    presets = {
        a.split("=", 1)[1]
        for c in COMMANDS
        for a in shlex.split(c, comments=True)
        if a.startswith("experiment=")
    }
    paper = {p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")}
    paper -= {p for p in paper if p.startswith(("demo", "toy_"))}
    assert paper <= presets, f"presets without a README command: {sorted(paper - presets)}"


def split(command: str, tmp: Path) -> tuple[str, list[str]]:
    """(script, arguments) with each ``<placeholder>`` made a path under ``tmp``."""
    # logs/train/runs/<run> and logs/train/multiruns/<name> are whole folders of the test's
    filled = re.sub(r"(?:logs/train/(?:multi)?runs/)?<([a-z0-9_-]+)>",
                    lambda m: str(tmp / m.group(1)), command)  # fmt: skip
    args = shlex.split(filled, comments=True)
    assert args[0] == "python", command
    if args[1] == "src/train.py":  # as src/train.py reads it, for Hydra
        args = ["dry_run=true" if a == "--check" else a for a in args]
    return args[1], args[2:]


def jobs(args: list[str]) -> list[list[str]]:
    """The override lists Hydra runs for ``args`` (one list, or one per job of a sweep)."""
    if "-m" not in args and "--multirun" not in args:
        return [args]
    rest = [a for a in args if a not in ("-m", "--multirun")]
    parsed = OverridesParser.create().parse_overrides(rest)
    out: list[list[str]] = [[]]
    for o in parsed:
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        key = o.get_key_element()
        out = [[*job, f"{key}={v}"] for job in out for v in values]
    return out


def check_train(cfg) -> None:
    """What src/train.py checks before loading anything, with 8 GPUs assumed; a ``--check``
    command's plan, too (its data and model may be absent here: listed, not asserted)."""
    validate(cfg)  # typed settings, the batch divided over the trainer's ranks
    assert resolve_batch(cfg, check_placement(cfg, gpus=8)) is not None
    if cfg.get("stage", {}).get("name", "rl") == "rl":
        instantiate(cfg.method)
    if cfg.get("dry_run"):
        from mrtpo.run.dryrun import check_all, plan_lines

        found = check_all(cfg)
        assert not [p for p in found.problems if p.startswith(("settings", "batch", "trainer"))]
        assert any("per step:" in line for line in plan_lines(cfg, found))


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_composes(command, tmp_path):
    script, args = split(command, tmp_path)
    if script not in HYDRA:
        where = (
            "test_relevance_command_renders_a_run"
            if "relevance" in script
            else "test_readme_commands_run_on_the_tiny_model (slow: it needs real runs)"
        )
        pytest.skip(f"{script} is not a Hydra entry point: run by {where}")
    if "--help" in args:
        res = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert res.returncode == 0 and "experiment" in res.stdout, res.stderr[-2000:]
        return
    if SLURM in args:
        pytest.importorskip(
            "hydra_plugins.hydra_submitit_launcher",
            reason="the slurm extra: pip install -e .[slurm]",
        )
    all_jobs = jobs(args)
    assert all_jobs
    for overrides in all_jobs:
        if script == "src/train.py":
            check_overrides(overrides)  # as src/train.py does before Hydra starts
        cfg = compose(HYDRA[script], overrides)
        if script == "src/train.py":
            check_train(cfg)


def test_relevance_command_renders_a_run(tmp_path):
    (command,) = [c for c in COMMANDS if " src/relevance.py " in c]
    script, args = split(command, tmp_path)
    run = Path(args[0])
    run.mkdir(parents=True)
    rec = {"step": 1, "id": "0", "beta": 0.5, "prompt": "p", "tokens": ["a", "b"],
           "token_ids": [1, 2], "rewards": {"fmt": 1.0}, "q": {"fmt": [0.1, 0.3]},
           "w": {"fmt": [0.75, 1.25]}}  # fmt: skip
    (run / "relevance.jsonl").write_text(json.dumps(rec) + "\n")
    res = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert (run / "relevance.html").is_file() and (run / "relevance.png").is_file()


# ---- run for real: the commands a CPU can run on the tiny model ---------------------------------
#: appended to every training command: a CPU-sized run of the same command
SMALL = ["trainer.max_steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
         "rollout.sampling.max_new_tokens=4", "callbacks.progress=null"]  # fmt: skip
MYMOD = """
def r1(prompt, response, answer, **row):
    return float(answer in response)


def r2(prompt, response, **row):
    return float(len(response) <= 8)
"""


def runs_on_a_cpu(script: str, args: list[str]) -> bool:
    """A command the tiny model runs here: no GPU trainer, model or engine, no public data."""
    if script == "src/relevance.py" or "--help" in args:
        return False  # run above
    if script == "src/table.py":  # its family's runs: test_readme_preset_to_table_runs...
        return False  # (the sweeps above are synthetic runs, which it refuses: issue 40)
    gpu = ("trainer=gpu", "rollout=vllm", "experiment=", "model=qwen", "task=text2sql", SLURM)
    return not any(a.startswith(g) for a in args for g in gpu)


def _run(script: str, args: list[str], cwd: Path, cache: Path) -> str:
    extra = []
    if script == "src/train.py":
        # (a resume too: it must name the run's own settings, and these are the test runs')
        extra = [*SMALL, f"paths.log_dir={cwd}/logs", f"paths.cache_dir={cache}"]
        if any(a.startswith("ckpt_path=") for a in args):  # on from the run's step 2
            extra.append("trainer.max_steps=4")
    elif script == "src/eval.py":
        extra = [f"paths.log_dir={cwd}/logs", f"paths.cache_dir={cache}"]
    elif script == "src/table.py":  # splits whose data is absent here are listed as absent
        extra = ["--set", f"paths.cache_dir={cache}", "--set", "eval.limit=2"]
    env = {**__import__("os").environ, "PYTHONPATH": f"{cwd}:{ROOT}", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / script), *args, *extra], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert res.returncode == 0, f"{script} {args}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.slow
def test_readme_commands_run_on_the_tiny_model(tmp_path, cache_dir):
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Say {w}.", "answer": w}) + "\n" for w in ("a", "b", "c"))
    )
    (tmp_path / "mymod.py").write_text(MYMOD)
    done, runs = [], tmp_path / "logs" / "train" / "runs"
    for command in COMMANDS:
        script, args = split(command, tmp_path)
        if not runs_on_a_cpu(script, args):
            continue
        first = sorted(runs.glob("*")) if runs.is_dir() else []
        sweeps = sorted((tmp_path / "logs" / "train" / "multiruns").glob("*"))
        # (src/report.py of two sweeps writes reports/, not into multiruns beside them)
        assert all(s.is_dir() for s in sweeps), f"not a sweep folder: {sweeps}"
        places = {"run": first[0] if first else None, "dir": tmp_path / "exported",
                  "gdpo": sweeps[0] if sweeps else None, "mrtpo": sweeps[-1] if sweeps else None}  # fmt: skip
        args = [_fill(a, tmp_path, places) for a in args]
        _run(script, args, tmp_path, cache_dir)
        done.append(command)
    assert any("src/report.py" in c for c in done) and any("src/export.py" in c for c in done)
    assert (tmp_path / "exported" / "config.json").is_file()


def _fill(arg: str, tmp: Path, places: dict) -> str:
    """An argument with the test folder's stand-ins replaced by what the earlier runs made."""
    for name, path in places.items():
        stand_in = str(tmp / name)
        if stand_in in arg:
            assert path is not None, f"no earlier run made a folder for <{name}>"
            arg = arg.replace(stand_in, str(path))
    return arg


# ---- the path from a preset to a paper table (issue 40) --------------------------------------

#: The preset swapped onto the tiny model and one CPU process, with its sizes shrunk (as in
#: test_presets.py): everything else is the preset's own.
TINY_PRESET = ["model=tiny", "rollout=hf", "trainer=cpu", "trainer.devices=1",
               "trainer.max_steps=1", "rl.global_prompts_per_step=2", "rl.group_size=2",
               "rollout.sampling.max_new_tokens=4", "data.val_prompts=0",
               "callbacks.progress=null"]  # fmt: skip


def preset_to_table() -> list[str]:
    """The commands of the README's 'From a preset to the paper's table' block."""
    text = README.read_text(encoding="utf-8")
    start = text.index("**From a preset to the paper's table.**")
    block = re.search(r"```bash\n(.*?)```", text[start:], flags=re.S)
    return [line.strip() for line in block[1].splitlines() if line.strip()]


@pytest.mark.slow  # six one-step training jobs, then the table's evaluations
def test_readme_preset_to_table_runs_on_the_tiny_model(tmp_path, cache_dir):
    """The README's three commands, run: the check passes and says what the run would do,
    the sweep trains the preset's rows, and table.py scores them on IFEval (the stand-in
    data's two prompts, eval.limit=1: each cell reads (1/2*), and the table says it is
    partial); the family's other benchmarks have no data here and are listed as absent."""
    from tests.integration.test_presets import HIR_ROWS, IFEVAL_ROWS

    check, sweep, table = preset_to_table()
    assert "--check" in check and " -m " in sweep and "src/table.py ifeval" in table
    data = tmp_path / "data"
    for rel, rows in (("HIR-16K/HIR_trainv1.jsonl", HIR_ROWS), ("ifeval/input_data.jsonl",
                                                                 IFEVAL_ROWS)):  # fmt: skip
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    paths = [f"paths.data_dir={data}", f"paths.log_dir={tmp_path}/logs",
             f"paths.cache_dir={cache_dir}"]  # fmt: skip

    def run(script: str, args: list[str]) -> str:
        res = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert res.returncode == 0, f"{args}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return res.stdout

    script, args = split(check, tmp_path)
    out = run(script, [*args, *TINY_PRESET, *paths])
    assert "no problem found" in out and "data: 2 training prompts" in out
    assert not (tmp_path / "logs").exists()  # the check wrote nothing
    script, args = split(sweep, tmp_path)
    run(script, [*args, *TINY_PRESET, *paths])
    (folder,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    script, args = split(table, tmp_path)
    args = [str(folder) if a == str(tmp_path / "sweep") else a for a in args]
    args = ["rollout=hf" if a == "rollout=vllm" else a for a in args]  # the tiny model's engine
    sets = [*paths[::2], "eval.limit=1", "rollout.sampling.max_new_tokens=4"]
    out = run(script, [*args, "--out", str(tmp_path / "table"),
                       *[w for s in sets for w in ("--set", s)]])  # fmt: skip
    md = (tmp_path / "table" / "table.md").read_text()
    assert "| method=gdpo | 1, 2, 3 |" in md and "| method=mrtpo | 1, 2, 3 |" in md
    assert md.count("(1/2*)") == 2 and "**Partial**: cells marked *" in md
    assert "IFBench (ifbench): absent" in md

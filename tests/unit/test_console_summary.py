"""The end-of-run table: whole headers and values at 80 columns, the run's own step numbers
(a resumed run does not restart at 1), the summed reward on its own axis of curves.png."""

from __future__ import annotations

from types import SimpleNamespace

from mrtpo.lightning.callbacks.console import RunSummary, column_groups


def _summary(first_step: int, k: int = 13) -> RunSummary:
    s = RunSummary(block=5, plot=True)
    for i in range(10):
        row = {f"reward/c{j}": 0.5 for j in range(k)}
        row["reward/total"] = 6.5
        s.rows.append(row)
        s.steps.append(first_step + i)
    return s


def test_resumed_run_labels_its_own_steps():
    head, body = _summary(21).table()
    assert [r[0] for r in body] == ["21-25", "26-30"]
    assert head[:2] == ["steps", "reward/total"]


def test_wide_table_is_split_not_truncated(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    s = _summary(1)
    head, body = s.table()
    groups = column_groups(head, body, 80)
    assert len(groups) > 1 and all(g[0] == 0 for g in groups)
    assert sorted({c for g in groups for c in g}) == list(range(len(head)))
    trainer = SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path))
    s.on_train_end(trainer, SimpleNamespace())
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(map(len, out.splitlines())) <= 80
    for name in ("total", "c0", "c12"):
        assert f" {name} " in out
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_header_offers_resume_only_when_the_run_saves_checkpoints():
    from tests.conftest import compose_config

    from mrtpo.lightning.callbacks.console import header

    saving = header(compose_config("train.yaml", ["paths.output_dir=/runs/a"]))
    # the hint repeats what was given beyond the run's saved overrides, then +resume=<folder>
    assert "python src/train.py paths.output_dir=/runs/a +resume=/runs/a)" in saving
    none = header(compose_config("train.yaml", ["paths.output_dir=/runs/a",
                                                "callbacks.model_checkpoint=null"]))  # fmt: skip
    assert "+resume=" not in none and "callbacks.model_checkpoint null" in none


def test_headers_show_the_tasks_reward_labels_and_keys_stay(tmp_path, capsys, monkeypatch):
    """Instruction following's slots read 'c0 (constraint 1)' ... 'c12 (constraint 13)' in the
    table and the curves' legend: the key report.py and --metric use (c0), with the task's
    label beside it (issue 40 item 7: the console said 'constraint 1', report.py 'c0'); the
    rows, and so the logged metric keys, keep c0..c12."""
    from mrtpo.tasks.instructions import InstructionTask

    monkeypatch.setenv("COLUMNS", "80")
    s = _summary(1)
    trainer = SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path))
    s.on_train_start(trainer, SimpleNamespace(task=InstructionTask(max_constraints=13)))
    s.on_train_end(trainer, SimpleNamespace())
    out = capsys.readouterr().out
    for name in ("total", "c0 (constraint 1)", "c12 (constraint 13)"):
        assert f" {name} " in out, out
    assert "…" not in out
    assert max(map(len, out.splitlines())) <= 80
    head, _ = s.table()  # the keys, slots in their order (c2 before c10)
    assert head == ["steps", "reward/total", *(f"reward/c{j}" for j in range(13))]
    assert out.index("(constraint 2)") < out.index("(constraint 10)")
    assert s.shown("reward/c12") == "c12 (constraint 13)" and s.shown("success") == "success"
    assert RunSummary().shown("reward/first") == "first"  # a task without labels: the key
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_curves_have_one_legend_outside_the_axes(tmp_path):
    """curves.png: one legend for both axes, below the plot (issue 40 item 7: the right
    axis' curve was drawn over the left axis' legend, beside a second legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = _summary(1, k=4)
    shown = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        fig.canvas.draw()
        shown["fig"] = fig
        shown["legends"] = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
        shown["bbox"] = [lg.get_window_extent() for lg in fig.legends]
        shown["axes"] = [a.get_window_extent() for a in fig.axes]
        shown["labels"] = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = keep
    try:
        s._plot(tmp_path / "curves.png")
    finally:
        plt.Figure.savefig = real_savefig
    assert shown["legends"] == []  # no legend inside an axes
    (legend,) = shown["bbox"]
    assert all(not legend.overlaps(a) for a in shown["axes"])
    assert "total (right axis)" in shown["labels"] and "c0" in shown["labels"]

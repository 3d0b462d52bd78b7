"""Section 2: the relevance kernel — Jensen–Shannon distance over the full vocabulary.

Each configuration runs in a fresh process (``python -m benchmarks.kernel --worker ...``) so that its peak memory is its
own: on CPU the growth of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` once the inputs exist; ``ru_maxrss`` elsewhere), on GPU
``torch.cuda.max_memory_allocated`` over the same baseline. Inputs are two logit tensors ``[T, V]`` (the P_all and P_\\k rows of one pair).

Implementations:
* ``unchunked``: ``log_softmax`` of both rows over all T, then ``credit.js_distance``;
* ``chunked``: ``credit.js_distance_chunked`` (``chunk`` positions at a time);
* ``replay``: replay's own scoring loop (``Replayer._score``) on the same logits;
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import child_pythonpath

IMPLS = ("unchunked", "chunked", "replay")


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the peak resident set (VmHWM) to the current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(impl: str, v: int, t: int, chunk: int, device: str, dtype: str, reps: int) -> dict:
    import torch

    dev = torch.device(device)
    states = _inputs(v, t, dev, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    fn = _kernels(states, chunk, dev)[impl]
    times, out, peak, err = _measure(fn, states, dev, reps)
    best = min(times)
    return {
        "impl": impl,
        "V": v,
        "T": t,
        "chunk": chunk if impl != "unchunked" else None,
        "device": device,
        "dtype": dtype,
        "seconds": best,
        "positions_per_s": t / best,
        "peak_extra_bytes": int(peak),
        "inputs_bytes": int(states.numel() * states.element_size()),
        "max_abs_diff_vs_js_distance": err,
        "mean_q": float(out.float().mean()),
    }


def _inputs(v: int, t: int, dev, dt):
    """``[2, T, V]`` logits: a peaked distribution, and a perturbation of it in the second
    row, as the P_all / P_\\k rows of one response are (mean q around 0.1-0.2)."""
    import torch

    torch.manual_seed(0)
    states = torch.empty((2, t, v), dtype=dt, device=dev)
    states.normal_()
    states[1].mul_(0.3).add_(states[0])
    states.mul_(2.0)
    return states


def _kernels(states, chunk: int, dev) -> dict:
    """The three implementations, each a function of no arguments over ``states``."""
    import torch

    from mrtpo.core.credit import RelevanceRequest, js_distance, js_distance_chunked
    from mrtpo.core.replay import ALL, Replayer, _Job, _Sink

    a, b = states[0], states[1]
    t = states.shape[1]

    def run_unchunked():
        return js_distance(torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1))

    def run_chunked():
        return js_distance_chunked(a, b, chunk=chunk)

    rep = Replayer(tokenizer=None, jsd_chunk=chunk)
    jobs = [_Job(0, ALL, []), _Job(0, "r", [])]

    class Roll:
        response_mask = torch.ones((1, t), dtype=torch.bool)
        response_ids = torch.zeros((1, t), dtype=torch.long)
        temperature = 1.0

    def run_replay():
        q = torch.zeros((1, 1, t), device=dev)
        logp = torch.zeros((1, t), device=dev)
        rep._score(jobs, states, None, _Sink(Roll, ("r",), RelevanceRequest(), q, logp))
        return q[0, 0]

    return {"unchunked": run_unchunked, "chunked": run_chunked, "replay": run_replay}


def _measure(fn, states, dev, reps: int):
    """(times, last output, peak bytes above the level before, max |diff| against the
    chunked kernel on the first 64 positions)."""
    import torch

    from mrtpo.core.credit import js_distance_chunked

    a, b = states[0], states[1]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # warm up on a few positions (kernels, allocator), then measure the real size
    with torch.no_grad():
        small = js_distance_chunked(a[:8], b[:8], chunk=8)
        del small
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            # imports peak and shrink again: measure from the current level, not the peak
            _reset_peak()
            base = _peak_bytes()
        times = []
        out = None
        for _ in range(reps):
            del out
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t0)
        peak = (
            torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else _peak_bytes() - base
        )
        ref = js_distance_chunked(a[:64], b[:64], chunk=64).float()
        err = float((out[:64].float() - ref).abs().max())
    return times, out, peak, err


def _available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return 8 << 30


def _launch(configs: list[tuple], threads: int) -> list[dict[str, Any]]:
    """Run ``configs`` — (impl, V, T, chunk, device, dtype, reps) each — one after another in
    one fresh worker process; a result or an ``error`` record per configuration."""
    cmd = [sys.executable, "-m", "benchmarks.kernel", "--worker"]
    cmd += [str(x) for c in configs for x in c]
    # A fixed mmap threshold: every large buffer is mapped and unmapped on free, so the
    # resident set follows live memory (glibc's sliding threshold would keep some freed
    # 32 MiB buffers on the heap and blur the peaks).
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MALLOC_MMAP_THRESHOLD_="1048576",
        # the worker imports mrtpo the way the parent did (installed, or a source tree on
        # PYTHONPATH), and this package from scripts/
        PYTHONPATH=child_pythonpath(),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out = [json.loads(ln) for ln in lines]
    for impl, v, t, *_ in configs[len(out) :]:  # the ones a crash left without a result
        out.append({"impl": impl, "V": v, "T": t, "error": proc.stderr.strip()[-400:]})
    return out


def _print(res: dict[str, Any]) -> None:
    if "positions_per_s" in res:
        print(
            f"  V={res['V']} T={res['T']} {res['impl']:9s} {res['positions_per_s']:10.0f} "
            f"pos/s  peak +{res['peak_extra_bytes'] / 2**20:8.1f} MiB",
            flush=True,
        )


def _too_big(impl: str, v: int, t: int, dtype: str, device: str, per_pos: float | None):
    """A skip record when the unchunked case measured at a shorter T (``per_pos`` bytes per
    position) predicts that this one would not fit in available memory; None to run it."""
    if impl != "unchunked" or per_pos is None:
        return None
    need = per_pos * t + 2 * t * v * (4 if dtype == "fp32" else 2)
    avail = _available_bytes(device)
    if need <= 0.6 * avail:
        return None
    return {
        "impl": impl,
        "V": v,
        "T": t,
        "skipped": f"predicted {need / 2**30:.1f} GiB > 60% of the "
        f"{avail / 2**30:.1f} GiB available",
    }


def run_all(
    vocab: list[int],
    lengths: list[int],
    chunk: int,
    device: str,
    dtype: str,
    threads: int,
    skip: set[tuple[str, int, int]] | None = None,
    quick: bool = False,
    one_process: bool = False,
) -> list[dict[str, Any]]:
    """Every (V, T, impl) in its own process, shortest first, except those in ``skip``; an
    unchunked case is also skipped when the measurement at a shorter T predicts it would not
    fit in available memory. ``one_process`` runs them all in a single worker instead (the
    GPU runner's dry run: it checks the plumbing, and one interpreter start is seconds where
    one per configuration is a minute; the peaks are then not each configuration's own)."""
    skip = skip or set()
    todo = [
        (impl, v, t, chunk, device, dtype, 1 if quick or t * v > 5e7 else 2)
        for v in vocab
        for t in sorted(lengths)
        for impl in IMPLS
        if (impl, v, t) not in skip
    ]
    if one_process:
        results = _launch(todo, threads)
        for res in results:
            _print(res)
        return results
    results: list[dict[str, Any]] = []
    per_pos: dict[tuple[str, int], float] = {}
    for config in todo:
        impl, v, t = config[:3]
        skipped = _too_big(impl, v, t, dtype, device, per_pos.get((impl, v)))
        if skipped:
            results.append(skipped)
            continue
        (res,) = _launch([config], threads)
        if "error" not in res:
            key = (impl, v)
            per_pos[key] = max(per_pos.get(key, 0.0), res["peak_extra_bytes"] / t)
        _print(res)
        results.append(res)
    return results


if __name__ == "__main__":  # the worker process of ``run_all``: 7 arguments per configuration
    args = sys.argv[2:]
    if len(sys.argv) < 9 or sys.argv[1] != "--worker" or len(args) % 7:
        raise SystemExit(
            "usage: python -m benchmarks.kernel --worker IMPL V T CHUNK DEVICE DTYPE REPS "
            "[IMPL V T CHUNK DEVICE DTYPE REPS ...]"
        )
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for i in range(0, len(args), 7):
        impl, v, t, chunk, device, dtype, reps = args[i : i + 7]
        res = worker(impl, int(v), int(t), int(chunk), device, dtype, int(reps))
        print(json.dumps(res), flush=True)

"""Number formats and small tables shared by the renderers of docs/benchmarks.md."""

from __future__ import annotations

import math
from typing import Any

MiB = 2**20
# the relevance kernel's peak is at most this many float32 [chunk, V] buffers
BOUND_CONSTANT = 16


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def _x(x: Any) -> str:
    return "–" if x is None else f"×{x:.2f}"


def _x3(x: Any) -> str:
    return "–" if x is None else f"×{x:.3f}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _on_cpu(d: dict[str, Any] | None) -> bool:
    return bool(d) and d["machine"].get("device") == "cpu"


def _judge(d: dict[str, Any], wall: float | None, cpu: float | None) -> float | None:
    """The ratio a target is judged on: CPU time on a (shared) CPU, wall-clock on GPU."""
    return cpu if _on_cpu(d) and cpu is not None else wall


def _status(value: float | None, limit: float) -> str:
    if value is None:
        return "not measured"
    if value <= limit:
        return "**met**"
    return f"**missed** by {100 * (value / limit - 1):.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _case_title(c: dict[str, Any]) -> str:
    n = c["B"] * c["G"]
    return (
        f"`{c['model']}` ({c.get('params_m', '?')}M parameters, V={c.get('vocab', '?')}): "
        f"B={c['B']} prompts × G={c['G']} (N={n}), K={c['K']} rewards, ≤{c['max_new_tokens']} "
        "new tokens"
    )


def _headline_case(rep: dict[str, Any] | None) -> dict[str, Any] | None:
    """The CPU-sized case of section 1 (``small``), else its last (largest) case."""
    if not rep or not rep.get("cases"):
        return None
    for c in rep["cases"]:
        if c["case"]["model"] == "small":
            return c
    return rep["cases"][-1]


def _kernel_flat(kern: dict[str, Any] | None, impl: str) -> list[tuple[int, float, float]]:
    """(V, peak at the shortest T, peak at the longest T) for ``impl``."""
    if not kern:
        return []
    out = []
    res = [r for r in kern["results"] if r.get("impl") == impl and "peak_extra_bytes" in r]
    for v in sorted({r["V"] for r in res}):
        rs = sorted((r for r in res if r["V"] == v), key=lambda r: r["T"])
        if len(rs) >= 2:
            out.append((v, rs[0]["peak_extra_bytes"], rs[-1]["peak_extra_bytes"]))
    return out

"""The decode suite's table (`bench/decode.py` measures): tokens/s per architecture, batch, mode
and decode path with ratios to Loop Transformer++, cache bytes per token, prefill speed, static
against eager, and the onóna heads' serving paths; '-' where a stop left a case unmeasured."""

from __future__ import annotations

from typing import Any

from tango_lm.bench.stopping import stopped_line

FELL_BACK = "; static steps ran eagerly (compile failed)"  # the note of such a row


def case_key(batch: int, mode: str, path: str) -> str:
    """'b1 greedy' (the eager decode) or 'b1 greedy static' (static decode steps)."""
    return f"b{batch} {mode}" + (" static" if path == "static" else "")


def _cell(value: float | None, width: int, spec: str) -> str:
    """A number right-aligned in `width`, or '-' where a stop left it unmeasured."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_report(report: dict[str, Any]) -> str:
    keys = [
        case_key(b, m, path)
        for b in report["batches"]
        for m in report["modes"]
        for path in report.get("paths", ["eager"])
    ]
    w = max(11, max(len(k) for k in keys) + 2)  # column width: the longest key and a gap
    measured_prefill = any(r.get("prefill_tokens_per_s") for r in report["archs"])
    prefill_keys = [f"b{b}" for b in report["batches"]] if measured_prefill else []
    models = f"the {report['tier']} presets" if report.get("tier") else "matched models of the train suite"
    static = (
        f"; static = static decode steps ({report['static_mode']}, serve/static_decode.py; the warm-up round compiles)"
        if report.get("static_mode")
        else ""
    )
    lines = [
        f"decode: device {report['device']} ({report['threads']} threads), {models} "
        f"(d={report['d_model']}, depth {report['depth']}, V={report['vocab_size']}), prompt {report['prompt_len']} "
        f"+ {report['new_tokens']} new tokens; tok/s = new tokens (all rows) / wall time of the whole generate call "
        f"(prefill included), median of {report['repeats']} rounds alternating models; cache = cache.nbytes() / "
        f"positions of one sequence at {report['prompt_len'] + report['new_tokens']} positions (fp32){static}; "
        f"prefill = prompt tokens (all rows) / s of the prompt's cached forward alone",
        f"{'arch':<19}"
        + "".join(f"{k:>{w}}" for k in keys)
        + "".join(f"{k + ' x':>{w + 2}}" for k in keys)
        + f"{'cache B/tok':>12}{'cache x':>8}"
        + "".join(f"{'prefill ' + k:>{len(k) + 10}}{'x':>6}" for k in prefill_keys)
        + "  note",
    ]
    for r in report["archs"]:
        lines.append(
            f"{r['arch']:<19}"
            + "".join(_cell(r["tokens_per_s"].get(k), w, ",.0f") for k in keys)
            + "".join(_cell(r["tokens_per_s_vs_loop"].get(k), w + 2, ".2f") for k in keys)
            + _cell(r["cache_bytes_per_token"], 12, ",.0f")
            + _cell(r["cache_vs_loop"], 8, ".2f")
            + "".join(
                _cell(r["prefill_tokens_per_s"].get(k), len(k) + 10, ",.0f")
                + _cell(r["prefill_vs_loop"].get(k), 6, ".2f")
                for k in prefill_keys
            )
            + f"  {r['note']}"
            + (FELL_BACK if r.get("static_failed") else "")
        )
    for r in report.get("skipped", []):
        lines.append(f"{r['arch']:<19}  {r['note']}")
    if report.get("static_mode"):
        eager_keys = [case_key(b, m, "eager") for b in report["batches"] for m in report["modes"]]
        lines.append(
            "static x eager (the same model): "
            + "; ".join(
                f"{r['arch']} " + " ".join(_cell(r["static_vs_eager"].get(k), 0, ".2f") for k in eager_keys)
                for r in report["archs"]
            )
            + f"  ({', '.join(eager_keys)})"
        )
    if report.get("heads"):
        h = report["heads"]
        bkeys = [
            f"b{b}" + (" static" if path == "static" else "")
            for b in report["batches"]
            for path in report.get("paths", ["eager"])
        ]
        hw = max(11, max(len(k) for k in bkeys) + 8)
        lines += [
            "",
            f"decode heads: {h['backbone']} backbone (d={h['d_model']}, depth {h['depth']}, width {h['width']}), "
            f"V={h['vocab_size']}, same body for every head, temperature 1 untruncated, prompt "
            f"{report['prompt_len']} + {report['new_tokens']} new tokens, median of {report['repeats']} rounds "
            f"alternating heads; ratios to Standard",
            f"{'variant':<12}"
            + "".join(f"{k + ' tok/s':>{hw}}" for k in bkeys)
            + "".join(f"{k + ' x':>{hw - 3}}" for k in bkeys)
            + "  path",
        ]
        for r in h["variants"]:
            lines.append(
                f"{r['variant']:<12}"
                + "".join(_cell(r["tokens_per_s"].get(k), hw, ",.0f") for k in bkeys)
                + "".join(_cell(r["tokens_per_s_vs_standard"].get(k), hw - 3, ".2f") for k in bkeys)
                + f"  {r['path']}"
                + (FELL_BACK if r.get("static_failed") else "")
            )
    if report.get("stopped"):
        stopped = report["stopped"]
        meaning = "each number is the median of the rounds its case finished; '-': not measured"
        lines.append(stopped_line(stopped, f"timed rounds of the {stopped['part']}", meaning))
    return "\n".join(lines)

"""The MUE / roofline report of a tuned layer: HTML (self-contained), Markdown, PNG and JSON.

``write_report(data, out_dir)`` writes ``report.json`` (the ``ReportData``), ``roofline.png``,
``report.md`` and ``report.html`` (figures embedded as data URIs, styles inline: no network needed
to open it).  ``python -m datamove.report DIR/report.json`` regenerates the others from the JSON.

Definitions (Ivanov et al., Sec. III-C), stated on the page too:
- Q: the operator's I/O lower bound, bytes: every distinct input and output element once
  (``dataflow.analysis``'s minimal element counts) x the element size;
- D: the bytes the chosen kernel moves, counted from the tensors it reads and writes (a generated
  kernel's, a GEMM's three operands, the attention's Q/K/V/O(/dO) and gradients, a layout change's
  read and write); re-reads inside a kernel are not counted, so D = Q except for layout changes
  (Q = 0: they move data no operator needs) and PyTorch's sequences (every unfused operator's I/O);
- B = D / time: the achieved bandwidth (shown per kernel, in TB/s and as % of B_peak); B_peak: the
  device's measured copy bandwidth;
- MUE = Q / D x B / B_peak x 100 (= Q / (time x B_peak) x 100).
"""
from __future__ import annotations

import base64
import html
import io
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2 ** 30


@dataclass
class KernelRow:
    """One kernel (a plan step, or PyTorch's sequence for one fused operator).

    ``cls``: contraction / normalization / elementwise / attention / layout change; ``flop``;
    ``input_elements`` / ``output_elements``: minimal I/O (elements); ``q_bytes`` / ``d_bytes``;
    ``time_ms`` and ``source`` ("measured" / "predicted"); ``kernel``: what runs."""

    name: str
    cls: str
    phase: str
    flop: int
    input_elements: int
    output_elements: int
    q_bytes: int
    d_bytes: int
    time_ms: float
    source: str
    kernel: str


@dataclass
class ReportData:
    """Everything the report shows.  ``meta``: spec, dims, dtype, device, ``measured`` (bool),
    versions, date, optionally ``shapes`` (every tuned shape: ``dims`` label, ``total_ms``, ``timing``;
    the report details the first); ``ceilings``: ``bandwidth`` (bytes/s), ``flops`` (flop/s) and where they come
    from (``source``); ``chosen``: the plan's steps; ``pytorch``: PyTorch eager per fused operator
    (the unfused operators it replaces); ``movement``: unfused vs fused minimal data movement
    (elements, ``dataflow.analysis.movement_summary``); ``plan``: ``total_ms``, ``best_sum_ms``;
    ``meta["tuning"]`` where the job measured: what its tuning cost per stage
    (``datamove.tuning.TuningReport.to_json``)."""

    meta: dict
    ceilings: dict
    chosen: list[KernelRow]
    pytorch: list[KernelRow]
    movement: dict
    plan: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ReportData":
        return cls(**{**data, "chosen": [KernelRow(**r) for r in data["chosen"]],
                      "pytorch": [KernelRow(**r) for r in data["pytorch"]]})


def achieved_bandwidth(row: KernelRow) -> float:
    """B = D / time, bytes/s (nan without a time or bytes)."""
    if row.time_ms <= 0 or row.d_bytes <= 0:
        return float("nan")
    return row.d_bytes / (row.time_ms * 1e-3)


def mue(row: KernelRow, bandwidth: float) -> float:
    """Q / D x B / B_peak x 100, B = D / time."""
    if row.time_ms <= 0 or row.d_bytes <= 0:
        return float("nan")
    return row.q_bytes / row.d_bytes * achieved_bandwidth(row) / bandwidth * 100


def peak_percent(row: KernelRow, flops: float) -> float:
    return row.flop / (row.time_ms * 1e-3) / flops * 100 if row.time_ms > 0 else float("nan")


def _label(data: ReportData) -> str:
    m = data.meta
    if m["measured"]:
        return f"measured on {m['device']}"
    return f"predicted ({m['device']}): nothing was measured"


def _table(rows: list[KernelRow], data: ReportData) -> list[list[str]]:
    c = data.ceilings
    body = [[r.name, r.cls, r.phase, f"{r.flop / GIB:.3f}", f"{r.input_elements / 1e6:.2f}",
             f"{r.output_elements / 1e6:.2f}", f"{r.time_ms:.4f}", r.source, f"{peak_percent(r, c['flops']):.1f}",
             f"{achieved_bandwidth(r) / 1e12:.2f}", f"{achieved_bandwidth(r) / c['bandwidth'] * 100:.0f}",
             f"{mue(r, c['bandwidth']):.1f}", r.kernel] for r in rows]
    return body


HEADER = ["operator", "class", "phase", "Gflop", "in (1e6)", "out (1e6)", "time ms", "time is", "% peak flop",
          "B TB/s", "B % of B_peak", "MUE %", "kernel"]


def class_totals(rows: list[KernelRow]) -> list[list[str]]:
    totals: dict[str, list[float]] = {}
    for r in rows:
        entry = totals.setdefault(r.cls, [0, 0.0, 0, 0])
        entry[0] += 1
        entry[1] += r.time_ms
        entry[2] += r.flop
        entry[3] += r.input_elements + r.output_elements
    result = [[cls, str(int(n)), f"{flop / GIB:.3f}", f"{moved / 1e6:.2f}", f"{ms:.4f}"]
              for cls, (n, ms, flop, moved) in sorted(totals.items())]
    result.append(["total", str(len(rows)), f"{sum(r.flop for r in rows) / GIB:.3f}",
                   f"{sum(r.input_elements + r.output_elements for r in rows) / 1e6:.2f}",
                   f"{sum(r.time_ms for r in rows):.4f}"])
    return result


TOTALS_HEADER = ["class", "kernels", "Gflop", "moved (1e6 elements)", "time ms"]


def speedups(data: ReportData) -> list[list[str]]:
    """PyTorch eager per fused operator against the chosen kernel(s) that run it."""
    by_operator = {}
    for r in data.chosen:
        for name in r.name.split("+"):
            by_operator.setdefault(name, []).append(r)
    rows = []
    for p in data.pytorch:
        ours = by_operator.get(p.name, [])
        ms = sum(r.time_ms for r in ours)
        ratio = f"{p.time_ms / ms:.2f}" if ms > 0 else "-"
        rows.append([p.name, p.cls, p.phase, f"{(p.input_elements + p.output_elements) / 1e6:.2f}",
                     f"{p.time_ms:.4f}", p.source, f"{ms:.4f}" if ours else "-", ratio])
    return rows


SPEEDUP_HEADER = ["fused operator", "class", "phase", "PyTorch moves (1e6 elements)", "PyTorch ms", "time is",
                  "chosen ms", "speedup"]


def roofline_png(data: ReportData) -> bytes:
    """Log-log roofline: the device's ceilings, each kernel at its arithmetic intensity (flop / D)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidth, flops = data.ceilings["bandwidth"], data.ceilings["flops"]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    intensity = [x for r in data.chosen + data.pytorch if r.flop and r.d_bytes for x in [r.flop / r.d_bytes]]
    low, high = min(intensity + [0.1]) / 4, max(intensity + [1000.0]) * 4
    xs = [low * (high / low) ** (k / 100) for k in range(101)]
    ax.plot(xs, [min(flops, bandwidth * x) for x in xs], color="black", linewidth=1.5, label="ceilings")
    for rows, marker, label in ((data.chosen, "o", "chosen kernels"), (data.pytorch, "x", "PyTorch eager")):
        points = [(r.flop / r.d_bytes, r.flop / (r.time_ms * 1e-3)) for r in rows if r.flop and r.d_bytes and r.time_ms > 0]
        if points:
            ax.scatter(*zip(*points), marker=marker, s=36, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / byte moved)")
    ax.set_ylabel("achieved flop/s")
    ax.set_title(f"{data.meta['spec']} {data.meta['dtype']}: {_label(data)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _definitions(data: ReportData) -> list[str]:
    c = data.ceilings
    return [f"Ceilings ({c['source']}): bandwidth B_peak = {c['bandwidth'] / 1e12:.2f} TB/s, "
            f"peak = {c['flops'] / 1e12:.0f} Tflop/s.",
            "Q: the operator's I/O lower bound (every distinct input and output element once x the element size). "
            "D: the bytes the chosen kernel moves (its tensors as it reads and writes them). "
            "B = D / time: achieved bandwidth. MUE = Q / D x B / B_peak x 100. Gflop = 2^30 flop.",
            f"Plan total {data.plan.get('total_ms', 0):.4f} ms; sum of per-operator bests "
            f"{data.plan.get('best_sum_ms', 0):.4f} ms (the paper's comparison).",
            *([("Shapes tuned, one plan each (this report: the first): " + "; ".join(
                f"{s['dims']} ({s['total_ms']:.4f} ms {s['timing']})" for s in data.meta["shapes"]) + ".")]
              if data.meta.get("shapes") else []),
            "Minimal data movement of the training graph, unfused -> fused operators: " + "; ".join(
                f"{key.replace('_', '-')} {data.movement['unfused'][key] / 1e6:.1f} -> {data.movement['fused'][key] / 1e6:.1f} "
                f"million elements ({percent:.1f}% less)" for key, percent in data.movement.get("reduction_percent", {}).items()
                if key in ("total", "non_contraction")) + "."]


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


TUNING_HEADER = ["tuning stage", "timed", "failed, too slow or wrong", "read back", "pruned", "left by the budget", "s"]


def tuning_rows(tuning: dict) -> list[list[str]]:
    """One row per stage of the job's tuning (``datamove.tuning.TuningReport.to_json``), then the total."""
    def row(name, counts, pruned, left, seconds):
        bad = sum(counts.get(k, 0) for k in ("failed", "too slow", "wrong"))
        return [name, str(counts.get("ok", 0) + counts.get("checked", 0)), str(bad), str(counts.get("skipped", 0)),
                pruned, str(left), f"{seconds:.0f}"]
    rows = [row(s["stage"], s["counts"], f"{s['pruned']} ({s['pruned_why']})" if s["pruned"] else "0", s["left"], s["wall_s"])
            for s in tuning["stages"]]
    return rows + [row("total", tuning["counts"], str(sum(s["pruned"] for s in tuning["stages"])), tuning["left"],
                       tuning["wall_s"])]


def _tuning_note(tuning: dict) -> str:
    return (f"Budget {tuning['budget_s']:g} s; " if tuning.get("budget_s") is not None else "") + \
        (tuning["stopped"] if tuning.get("stopped") else "every stage finished") + "."


def markdown(data: ReportData) -> str:
    m = data.meta
    parts = [f"# {m['spec']}: tuned layer report", "",
             f"**{_label(data)}.** Dims {m['dims']}, {m['dtype']}, {m['date']}.", ""]
    parts += [line + "\n" for line in _definitions(data)]
    parts += ["## Chosen kernels (Table III style)", "", _markdown_table(HEADER, _table(data.chosen, data)), "",
              "Totals per class:", "", _markdown_table(TOTALS_HEADER, class_totals(data.chosen)), "",
              "## PyTorch eager per fused operator", "", _markdown_table(SPEEDUP_HEADER, speedups(data)), ""]
    if m.get("tuning"):
        parts += ["## Tuning cost", "", _tuning_note(m["tuning"]), "", _markdown_table(TUNING_HEADER, tuning_rows(m["tuning"])), ""]
    parts += ["## Roofline", "", "![roofline](roofline.png)", ""]
    return "\n".join(parts)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:12px;"
         "margin:1em 0}td,th{border:1px solid #bbb;padding:2px 6px;text-align:right}td:first-child,th:first-child,"
         "td:last-child{text-align:left}.label{background:#fff3cd;padding:.5em;border:1px solid #e0c36c}")


def html_page(data: ReportData, png: bytes) -> str:
    m = data.meta
    image = base64.b64encode(png).decode()
    definitions = "".join(f"<p>{html.escape(line)}</p>" for line in _definitions(data))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(m['spec'])} report</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(m['spec'])}: tuned layer report</h1>"
            f"<p class='label'><b>{html.escape(_label(data))}.</b> Dims {html.escape(str(m['dims']))}, "
            f"{html.escape(m['dtype'])}, {html.escape(m['date'])}.</p>{definitions}"
            f"<h2>Chosen kernels (Table III style)</h2>{_html_table(HEADER, _table(data.chosen, data))}"
            f"<p>Totals per class:</p>{_html_table(TOTALS_HEADER, class_totals(data.chosen))}"
            f"<h2>PyTorch eager per fused operator</h2>{_html_table(SPEEDUP_HEADER, speedups(data))}"
            + (f"<h2>Tuning cost</h2><p>{html.escape(_tuning_note(m['tuning']))}</p>"
               f"{_html_table(TUNING_HEADER, tuning_rows(m['tuning']))}" if m.get("tuning") else "")
            + f"<h2>Roofline</h2><img alt='roofline' src='data:image/png;base64,{image}'></body></html>")


def write_report(data: ReportData, out_dir) -> dict[str, Path]:
    """Write the report files into ``out_dir``; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = roofline_png(data)  # every page rendered before any file is written
    pages = {"json": json.dumps(data.to_json(), indent=1), "png": png, "markdown": markdown(data),
             "html": html_page(data, png)}
    paths = {"json": out / "report.json", "png": out / "roofline.png", "markdown": out / "report.md",
             "html": out / "report.html"}
    for kind, page in pages.items():
        if isinstance(page, bytes):
            paths[kind].write_bytes(page)
        else:
            paths[kind].write_text(page, encoding="utf-8")
    return paths


USAGE = "python -m datamove.report DIR/report.json"


def main(argv: list[str] | None = None) -> int:
    """Regenerate the report files beside a ``report.json``; a missing or damaged one is refused in
    one line (exit status 2)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"datamove.report: error: usage: {USAGE} (regenerates report.html, report.md and roofline.png "
              f"beside it)", file=sys.stderr)
        return 2
    source = Path(args[0])
    rewrite = "write it again with optimize-layer SPEC --out DIR"
    try:
        if source.is_dir():
            raise ValueError(f"a folder: give the report.json inside it ({USAGE})")
        if not source.is_file():
            raise ValueError(f"no such file: give the report.json optimize-layer wrote ({USAGE})")
        try:
            raw = json.loads(source.read_text(encoding="utf-8"))
        except ValueError as err:  # not UTF-8, or not JSON
            raise ValueError(f"not valid JSON ({err}): {rewrite}") from None
        try:  # every page is rendered before any file is written
            paths = write_report(ReportData.from_json(raw), source.parent)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as err:
            raise ValueError(f"not a datamove report.json ({type(err).__name__}: {err}): {rewrite}") from None
    except (ValueError, OSError) as err:
        print(f"datamove.report: error: {source}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("datamove.report: interrupted", file=sys.stderr)
        return 130
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":  # regenerate: python -m datamove.report DIR/report.json
    sys.exit(main())

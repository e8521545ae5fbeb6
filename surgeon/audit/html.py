"""The audit as one self-contained HTML page: the summary, two plots (matplotlib PNGs embedded as
base64) and the outliers by file.

* norm profile: the target's per-point identity statistic (median log per-token norm, with its
  tolerance band) in forward-pass order, and each slot's mean over the set (with its spread
  over files) drawn at its declared point: a slot off the curve at its point is visible at once;
* identity histogram: per slot, how many files' slots sit nearest to each point (the :data:`BARS`
  largest, "+N more" where there are more);

and, before them, the verdict (undecided included: :mod:`surgeon.audit.summary`) and each slot's
identity counts: the statistics' verdicts, exact identification's, the files neither decided.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from surgeon.audit.output import AuditSlot
from surgeon.audit.summary import counts, histogram
from surgeon.core.errors import BadInput
from surgeon.core.safefile import UnsafeFile, write_file

BARS = 8  # the identity histogram's bars per slot (the rest: "+N more")


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _profile_figure(profile: Any, slots: list[AuditSlot]):
    """``profile``: a :class:`~surgeon.audit.profile.Profile` or None; ``slots``: their models."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = {}
    if profile:
        pts = profile.points
        xs = {p.point: i for i, p in enumerate(pts)}
        c = [p.centre for p in pts]
        ax.plot(range(len(pts)), c, "k.-", label="target profile")
        ax.fill_between(range(len(pts)), [p.centre - p.tol for p in pts], [p.centre + p.tol for p in pts],
                        color="grey", alpha=0.25, label="tolerance")
        ax.set_xticks(range(len(pts)))
        ax.set_xticklabels([p.point for p in pts], rotation=60, fontsize=7)
    for k, s in enumerate(slots):
        if s.log_norm_median_mean is None:
            continue
        x = xs.get(s.declared, len(xs) + k)
        ax.errorbar([x + 0.08 * (k - 1)], [s.log_norm_median_mean], yerr=[s.log_norm_median_std or 0.0], fmt="o",
                    capsize=3, label=f"{s.name} (declared {s.declared})")
    ax.set_ylabel("median log per-token norm")
    ax.set_title("each slot over the set, at its declared point, against the target's profile", fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # nothing to label (a structure pass): no legend, no warning
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _histogram_figure(slots: list[AuditSlot]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(slots)), figsize=(3 * max(1, len(slots)), 3), squeeze=False)
    for ax, s in zip(axes[0], slots):
        items, more = histogram(s, BARS)
        ax.bar(range(len(items)), [v for _, v in items],
               color=["tab:green" if k == s.declared else "tab:red" for k, _ in items])
        ax.set_xticks(range(len(items)))
        ax.set_xticklabels([k for k, _ in items], rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{s.name} (declared {s.declared})" + (f", +{more} more" if more else ""), fontsize=8)
    fig.suptitle("identity histogram: files per nearest point (green: the declared one)", fontsize=9)
    fig.tight_layout()
    return fig


def _slot_table(slots: list[AuditSlot], undecided: list[str]) -> str:
    """Per slot: the identity verdicts of the statistics, exact identification's, the files neither
    decided, and the histogram's points (all of them: the plot shows :data:`BARS`)."""
    e = html.escape
    head = "".join(f"<th>{h}</th>" for h in ("slot", "declared", "files", "ok", "mismatch", "no_match", "unresolved",
                                             "not_run", "exact", "undecided", "identity (nearest point: files)"))
    rows = []
    for s in slots:
        bars, more = histogram(s, BARS)
        ident = ", ".join(f"{k}: {v}" for k, v in bars) + (f", +{more} more" if more else "")
        exact = ", ".join(f"{k} {v}" for k, v in s.exact_verdicts.items() if v) or "-"
        cells = [s.name, s.declared or "-", s.files, *(s.verdicts.get(v, 0) for v in
                 ("ok", "mismatch", "no_match", "unresolved", "not_run")), exact, s.undecided, ident]
        style = ' style="background:#fff3c4"' if s.name in undecided else ""
        rows.append(f"<tr{style} title=\"{e(counts(s))}\">" + "".join(f"<td>{e(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def write_report(report: Any, path: str | Path) -> Path:
    """Write ``report`` (an :class:`~surgeon.audit.pipeline.AuditReport`, read by the names of its
    JSON's keys) as one HTML page at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    r, e = report, html.escape
    slots = [AuditSlot.model_validate(s, from_attributes=True) for s in r.slots]
    ex = r.exact
    rows = "".join(
        f"<tr><td>{e(o['path'])}</td><td>{'<br>'.join(e(f['kind'] + (' ' + f['slot'] if f['slot'] else '') + ': ' + f['detail']) for f in o['findings'])}</td></tr>"  # noqa: E501
        for o in r.outliers)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>surgeon audit {e(r.root)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td{{vertical-align:top;padding:2px 8px;border-bottom:1px solid #ddd}}</style>
</head><body><h1>surgeon audit: {e(r.root)}</h1>
<p><b>{e(r.verdict.upper())}</b>: {e(r.headline.partition(': ')[2])}</p>
<p>{r.flagged} of {r.files} files flagged
({e(', '.join(f'{k} {v}' for k, v in r.findings.items())) or 'nothing'}); spec {e(r.spec)};
{r.files_per_s or '-'} files/s, {r.mb_per_s or '-'} MB/s.</p>
<h2>Identity per slot</h2>{_slot_table(slots, r.undecided)}
<p>exact identification: {ex.files} files ({ex.escalated} of the {ex.undecided_files}
the statistics left undecided, {ex.spot_checked} spot checks; {e(ex.rule)}), {ex.found}
with a slot not its declared point.</p>
<h2>Norm profile</h2><img alt="norm profile" src="data:image/png;base64,{_png(_profile_figure(r.profile, slots))}">
<h2>Identity histogram</h2><img alt="identity histogram" src="data:image/png;base64,{_png(_histogram_figure(slots))}">
<h2>Outliers by file</h2><table>{rows or '<tr><td>none</td></tr>'}</table>
<h2>Notes</h2><ul>{''.join(f'<li>{e(n)}</li>' for n in r.notes)}</ul></body></html>"""
    out = Path(path)
    try:  # never through a link, never over a file (one made there during the audit included)
        write_file(out, page.encode("utf-8"), what="the --report file", mode=0o644)
    except UnsafeFile as e:
        raise BadInput(f"--report {e}") from None
    return out

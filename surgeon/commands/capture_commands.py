"""Commands on capture code and dumps: hooks, check-hooks, dump-info, export."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from surgeon.commands.results import DumpInfo, Exported, GeneratedText, HookCheck, write_new_file
from surgeon.core.errors import BadInput, InternalError


def hooks(*, spec: str, mode: Literal["aux", "dump"], max_tokens: int, output: str | None = None) -> GeneratedText:
    """The CUDA-graph-safe capture hooks module for ``spec``, checked before anyone gets it."""
    from surgeon.capture.graphsafe import check_source
    from surgeon.capture.hooks import generate_hooks_module
    from surgeon.core.spec import load_spec

    source = generate_hooks_module(load_spec(spec), mode=mode, max_tokens=max_tokens)
    findings = check_source(source, "<generated>")
    if findings:  # the generator's own contract: never hand out unsafe code
        raise InternalError(f"generated hooks fail the graph-safety check: {findings[0]}")
    return write_new_file(source, output)


def check_hooks(*, files: Sequence[str]) -> HookCheck:
    """Static graph-safety check of hook code; any finding is a mismatch (exit 3)."""
    from surgeon.capture.graphsafe import check_file

    findings = []
    for f in files:
        try:
            findings += check_file(f)
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"{f}: cannot read as UTF-8 text: {getattr(e, 'strerror', None) or e}") from None
    return HookCheck(len(files), findings)


def dump_info(*, dump: str) -> DumpInfo:
    """What a surgeon dump says it is, read from its header alone (no tensor loaded, no torch)."""
    from surgeon.capture.dumps import read_dump_header

    d = read_dump_header(dump)
    return DumpInfo(dump, {k: v for k, v in d.meta.items() if k != "captures"},
                    [{"name": n, "point": str(p), "shape": shape} for n, p, shape in d.captures])


def export(*, dumps: Sequence[str], spec: str, layout: str, out_dir: str) -> Exported:
    """Export dumps to a training tool's layout (specforge or speculators), or refuse."""
    from surgeon.capture.exporters import export_specforge, export_speculators
    from surgeon.core.spec import load_spec

    s = load_spec(spec)
    exporter = export_specforge if layout == "specforge" else export_speculators
    return Exported(layout, out_dir, list(exporter(list(dumps), out_dir, spec=s)))

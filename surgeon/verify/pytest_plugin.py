"""pytest plugin (entry point ``pytest11``): test a repository's specs against golden fingerprints
or an HF reference in one line.

    def test_kimi_wiring(surgeon_verify):
        surgeon_verify("specs/kimi.yaml", subject="dumps/sample0.ckpt", reference="specs/kimi.fp.safetensors")

or, with no body of its own:

    @pytest.mark.surgeon_wiring("specs/kimi.yaml", subject="dumps/sample0.ckpt", reference="hf:models/tiny")
    def test_kimi_wiring(surgeon_verify):
        surgeon_verify()

Relative paths resolve against pytest's rootdir (the folder of the project's ``pyproject.toml`` /
``pytest.ini``, whichever folder the test file is in), absolute ones are taken as given. A failure is
one assertion message: every wrong slot with its true point and the corrected ids, or the one
located line of a bad input (a spec that does not load, a missing dump), never a traceback of
surgeon's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from surgeon.core.errors import SurgeonError


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "surgeon_wiring(spec, subject=..., reference=..., slots=(), input_ids=None): "
        "verify a dump against a spec's declared wiring",
    )


class WiringError(AssertionError):
    """The subject's slots are not what the spec declares."""


def _format(result) -> str:
    differs = "cannot be judged against" if result.verdict == "undecided" else "differs from"
    lines = [f"wiring of {result.subject.source} {differs} the spec: {result.headline}"]
    for s in result.report.slots:
        if s.verdict not in ("ok", "unlabelled"):
            lines.append(f"  {s.name}: declared {s.declared}, is {s.matched or 'no one point'} "
                         f"(rel err {s.rel_err:.4f}, margin {s.margin_text}, {s.verdict})")
    lines += [f"  {d.kind}: {d.detail}" for d in result.report.diagnosis]
    if result.engine_ids:
        lines.append(f"  corrected engine ids: {result.engine_ids}")
    return "\n".join(lines)


def _resolver(root: Path):
    """``resolve(p)``: ``p`` (a path, or ``hf:PATH``) with a relative path taken against ``root``."""

    def resolve(p: str | Path) -> str:
        text = str(p)
        prefix, path = ("hf:", text[3:]) if text.startswith("hf:") else ("", text)
        return prefix + (path if Path(path).is_absolute() else str(root / path))

    return resolve


@pytest.fixture
def surgeon_verify(request: pytest.FixtureRequest):
    """A callable ``verify(spec, subject=..., reference=..., slots=(), input_ids=None)`` that
    returns the harness result when every slot is what the spec declares and fails the test with
    each wrong slot's true point otherwise. Without arguments it takes them from the test's
    ``surgeon_wiring`` marker. Relative paths resolve against pytest's rootdir."""
    from surgeon.core.spec import load_spec
    from surgeon.verify.harness import match

    resolve = _resolver(Path(request.config.rootpath))
    marker = request.node.get_closest_marker("surgeon_wiring")

    def verify(spec: str | None = None, *, subject: str | None = None, reference: str | None = None,
               slots=(), input_ids: str | None = None):
        __tracebackhide__ = True  # the report shows the test's own line, not the plugin's
        if spec is None:
            if marker is None:
                raise pytest.UsageError("surgeon_verify() without arguments needs a @pytest.mark.surgeon_wiring marker")
            spec = marker.args[0] if marker.args else marker.kwargs["spec"]
            subject = subject or marker.kwargs.get("subject")
            reference = reference or marker.kwargs.get("reference")
            slots = slots or marker.kwargs.get("slots", ())
            input_ids = input_ids or marker.kwargs.get("input_ids")
        if subject is None or reference is None:
            raise pytest.UsageError("surgeon_verify needs subject= and reference=")
        bad: str | None = None
        try:
            result = match(resolve(subject), resolve(reference), spec=load_spec(resolve(spec)), slots=slots,
                           input_ids=input_ids)
        except SurgeonError as e:
            bad = "\n".join(e.report_lines()).removeprefix("surgeon: ")
        if bad is not None:  # outside the except: no "during handling of the above exception" chain
            pytest.fail(f"surgeon_verify: {bad}", pytrace=False)
        if not result.ok:
            raise WiringError(_format(result))
        return result

    return verify

"""The ``--json`` output models of capture code and dumps: dump-info, export, check-hooks. Each
reads its command's result (:mod:`surgeon.commands.capture_commands`: ``DumpInfo``, ``Exported``,
``HookCheck``, its findings ``surgeon.capture.graphsafe.Finding``) by its field names; a dump's
captures, producer and records are built as these models by the command."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed, PathText, Point


class DumpCapture(Closed):
    name: str
    point: Point | None = Field(description="null: the file does not record it (a TensorRT-LLM or Model Optimizer "
                                            "dump without --slots)")
    shape: list[int] | None = Field(description="[tokens, hidden]; of the first record in a file of several")
    dtype: str | None = None


class DumpProducer(Closed):
    detected: list[str] = Field(description="the producers whose writer gives a file these keys "
                                            "(trtllm, modelopt-hf, modelopt-vllm, modelopt-trtllm)")
    why: str = Field(description="what in the file decides it, with the writer's file:line")
    given: str | None = Field(description="the --slots PRODUCER:IDS the slots are labelled by; null: none")


class DumpRecord(Closed):
    index: int
    id: str | None = Field(description="the record's id in the file (TensorRT-LLM 'id N', Model Optimizer "
                                       "'conversation C'); null when it has none")
    tokens: int = Field(description="this record's tokens")
    input_ids: bool
    loss_mask: int | None = Field(description="tokens in the loss (Model Optimizer's loss_mask); null: no mask")


class DumpSpec(Closed):
    name: str | None
    sha256: str | None


class DumpInfoOutput(_Output):
    file: str
    dump_format: int | None = Field(description="the dump file's own format number")
    spec: DumpSpec
    engine: str | None
    engine_version: str | None
    model: str | None
    num_layers: int | None
    hidden_size: int | None = Field(description="the captures' hidden size (a file of several records: the first's)")
    tokens: int | None = Field(description="the captures' tokens: one sequence's, the first record's in a file of "
                                           "several (records[].tokens gives each record's)")
    dtype: str | None = Field(description="the captures' dtypes, comma-separated (a file of several records: the first's)")
    captures: list[DumpCapture] = Field(description="the slots of the dump's one sequence, or of its first record")
    other_metadata: dict[str, str] = Field(description="metadata keys this surgeon does not interpret")
    layout: Literal["surgeon", "trtllm", "modelopt", "specforge", "vllm-connector"] = Field(
        default="surgeon",
        description="surgeon dump, TensorRT-LLM SaveHiddenStates list, Model Optimizer collect_hidden_states dict, "
                    "SpecForge .ckpt, or vLLM hidden-state connector / speculators hidden_states stack")
    labelled: bool = Field(default=True, description="every capture's point is known")
    producer: DumpProducer | None = Field(default=None,
                                          description="a TensorRT-LLM or Model Optimizer dump's; null for a surgeon dump")
    records: list[DumpRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class ExportOutput(_Output):
    layout: Literal["specforge", "speculators"]
    written: list[PathText]
    manifest: PathText | None = Field(default=None,
                                      description="surgeon-export.json: per written file its source and each slot's point")


class HookFinding(Closed):
    file: str
    line: int
    col: int
    rule: str
    message: str


class CheckHooksOutput(_Output):
    ok: bool = Field(description="no finding (exit 3 otherwise)")
    findings: list[HookFinding]

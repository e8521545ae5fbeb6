"""Engine probes: what an installed engine's aux-hidden-state ids mean, read from its source.

>>> from surgeon.engines.probes.probe import probe_engine
>>> probe = probe_engine("sglang")                       # doctest: +SKIP
>>> probe.get("LlamaForCausalLM").capture([1, 15, 28], 32)  # doctest: +SKIP
[2, 16, 29]

The probe never imports the engine. It reads the model files (``srt/models`` for SGLang,
``model_executor/models`` for vLLM) in three tiers (:mod:`surgeon.engines.source.index`), runs each
class's capture setter symbolically (:mod:`surgeon.engines.interp`), and reads the capture loop of
the class the ids end up in (:mod:`surgeon.engines.probes.capture`). Results are cached on disk, keyed on
the content of every model file and on the probe's own code (:mod:`surgeon.engines.probes.cache`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import cast

from surgeon.core.errors import SurgeonError, unreadable
from surgeon.core.idrules import ClassConvention, Engine, EngineProbe
from surgeon.engines.probes import cache as _cache
from surgeon.engines.probes import sglang as _sglang
from surgeon.engines.probes import vllm as _vllm
from surgeon.engines.probes.capture import CaptureAnalyzer
from surgeon.engines.probes.classify import Classifier, Target
from surgeon.engines.probes.dispatch import DEFAULT_PLATFORM, PLATFORMS
from surgeon.engines.probes.runner import read_runner
from surgeon.engines.source.forked import map_forked
from surgeon.engines.source.index import ClassKey, SourceIndex
from surgeon.engines.source.locate import EngineLocation, ProbeError, layout_of, locate_engine

__all__ = ["probe_engine", "locate_engine", "EngineLocation", "ProbeError", "EngineProbe", "ClassConvention"]

_ENGINES = {"sglang": _sglang, "vllm": _vllm}

Progress = Callable[[int, int], None]  # (files done, files): the candidate files, classified file by file
RUNNER_SHARE = 8  # reading the model runner costs about an eighth of classifying (vLLM 0.33: 1 s of 8)


def probe_engine(engine: str, root: str | Path | None = None, *, progress: Progress | None = None,
                 cache: bool | None = None, platform: str | None = None) -> EngineProbe:
    """Probe ``engine`` ("sglang" or "vllm") at ``root`` (the package directory or a folder holding
    it; ``None``: the installed package). ``progress(done, total)`` is called as classes are
    classified. ``cache``: use the on-disk cache (default: yes, unless ``SURGEON_NO_CACHE`` is set).
    ``platform``: what the answers hold for (:func:`engine_platform`; vLLM picks some classes per
    platform, SGLang does not and its probe says "all").

    Raises :class:`ProbeError` when there is nothing to probe.
    """
    location = locate_engine(engine, root)
    layout = layout_of(engine)
    plat = engine_platform(engine, platform)
    index = SourceIndex(location.root, layout.package, location.models_dirs)
    if not index.model_files:
        raise ProbeError(f"{location.models_dir} holds no model files")
    use_cache = (not os.environ.get("SURGEON_NO_CACHE")) if cache is None else cache
    cache_key = _cache.key(engine, index, plat, support_files(index, layout.support_dirs)) if use_cache else None
    if cache_key is not None:
        hit = _cache.load(cache_key, index)
        if hit is not None:
            hit.root = str(location.root)
            hit.version = location.version
            hit.runner = read_runner(engine, location.root, location.version)  # runner files are not in the cache key
            if progress:
                progress(len(hit.classes), len(hit.classes))
            return hit
    probe = _probe(engine, location, index, progress, plat)
    if cache_key is not None:
        keyed = set(index.model_files) | set(support_files(index, layout.support_dirs))
        _cache.store(cache_key, probe, {p: index.fingerprint([p]) for p in index.read_paths() if p not in keyed})
    return probe


def engine_platform(engine: str, platform: str | None) -> str:
    """The platform a probe of ``engine`` answers for: SGLang registers one class per
    architecture whatever the platform ("all"); vLLM dispatches some per platform (default cuda)."""
    if engine != "vllm":
        return "all"
    plat = platform or DEFAULT_PLATFORM
    if plat not in PLATFORMS:
        raise ProbeError(f"unknown platform {plat!r} (known: {', '.join(PLATFORMS)})")
    return plat


def support_files(index: SourceIndex, dirs: tuple[str, ...]) -> list[str]:
    """The non-model files the probe reads (vLLM ``platforms/*.py``), for the cache key."""
    out: list[str] = []
    for d in dirs:
        base = index.package_dir / d
        if base.is_dir():
            out += sorted(p.relative_to(index.package_dir).as_posix() for p in base.glob("*.py"))
    return out


def _probe(name: str, location: EngineLocation, index: SourceIndex, progress: Progress | None,
           platform: str = "all") -> EngineProbe:
    mod = _ENGINES[name]
    engine = cast(Engine, name)  # _ENGINES holds exactly the Engine names, and it knew this one
    _, files = mod.select(index, only=())  # the candidate files (a text prefilter: nothing parsed yet)
    hooks = _vllm.hooks(index, platform) if engine == "vllm" else mod.hooks(index)
    classifier = Classifier(engine, index, hooks, CaptureAnalyzer(index), mod.extra_notes(index))
    interface_problem = _vllm.check_interface(index) if engine == "vllm" else None

    def one(target: Target) -> ClassConvention:
        if interface_problem:
            info = index.class_info(target.key)
            return ClassConvention(engine=engine, path=target.key[0], class_name=target.key[1],
                                   line=info.line if info else 0, status="unclassified", reason=interface_problem)
        return classifier.classify(target)

    def per_file(path: str) -> tuple[list[tuple[Target, ClassConvention]], str | None]:
        """The file's classes and their conventions; a file the reader cannot handle is one
        "unreadable" entry (why), never the end of the probe."""
        try:
            return [(t, one(t)) for t in mod.select(index, only={path})[0]], None
        except SurgeonError:
            raise
        except Exception as e:
            return [], unreadable(e)

    # Files, not classes, are the unit of work: what a file's classes share (its parse, its bases)
    # is read once. The runner (one large file) is read here while the child works.
    sizes = [len(index.text(f) or "") for f in files]
    per, child_reads, runner = map_forked(
        files, per_file, weights=sizes, groups=list(range(len(files))),
        progress=(lambda done: progress(done, len(files))) if progress else None,
        child_state=index.read_paths, alongside=lambda: read_runner(name, location.root, location.version),
        alongside_weight=sum(sizes) // RUNNER_SHARE)
    for path in child_reads or []:  # what the child read counts for the cache like what this process read
        index.text(path)
    conventions: list[tuple[Target, ClassConvention]] = [pair for pairs, _ in per for pair in pairs]
    exported = _vllm.exported(index, files, platform) if engine == "vllm" else mod.exported(index, files)
    probe = EngineProbe(engine=engine, version=location.version, root=str(location.root),
                        files_scanned=len(index.model_files), platform=platform, runner=runner,
                        unreadable=_unreadable(index, files, per))
    keys = _keys(conventions, set(exported.values()))
    for (target, cc), k in zip(conventions, keys):
        probe.classes[k] = cc
        if target.defines:
            probe.defining.add(k)
    by_class = {(cc.path, cc.class_name): k for (_, cc), k in zip(conventions, keys)}
    probe.architectures = {arch: by_class[key] for arch, key in sorted(exported.items()) if key in by_class}
    probe.registered = {arch: _where(index, key) for arch, key in sorted(exported.items()) if key not in by_class}
    if engine == "vllm":
        probe.dispatch = _vllm.dispatch_table(index, platform, by_class, probe.classes)
    return probe


def _where(index: SourceIndex, key: ClassKey) -> str:
    """``path:line Class`` by a text search for the class statement (no parse: the registry names
    hundreds of classes and only their location is wanted)."""
    path, name = key
    text = index.text(path) or ""
    found = re.search(rf"^class {re.escape(name)}\b", text, re.M)
    return f"{path}:{text.count(chr(10), 0, found.start()) + 1} {name}" if found else f"{path} {name} (not found there)"


def _keys(conventions: list[tuple[Target, ClassConvention]], exported: set) -> list[str]:
    """Dictionary keys: the class name, unless two files define a class of that name; then the
    registered one (SGLang EntryClass, vLLM registry) keeps the bare name and the others are
    ``path:Class``."""
    by_name: dict[str, list[int]] = {}
    for i, (_, cc) in enumerate(conventions):
        by_name.setdefault(cc.class_name, []).append(i)
    keys = [cc.class_name for _, cc in conventions]
    for name, idxs in by_name.items():
        if len(idxs) == 1:
            continue
        preferred = [i for i in idxs if (conventions[i][1].path, name) in exported]
        for i in idxs:
            if len(preferred) == 1 and i == preferred[0]:
                continue
            keys[i] = f"{conventions[i][1].path}:{name}"
    return keys


def _unreadable(index: SourceIndex, files: list[str], per: list) -> dict[str, str]:
    """Model files the probe could not read: those the safe reader refused (a FIFO, a device, an
    over-large file named ``*.py``) and those whose reading raised."""
    models = set(index.model_files)
    refused = {f: why for f, why in index.refused.items() if f in models}
    return {**refused, **{f: why for f, (_, why) in zip(files, per) if why is not None}}

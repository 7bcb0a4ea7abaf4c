#!/usr/bin/env python
"""Make feature-deletion and procedural-bug tasks from Python repositories with a pytest suite.

Each SOURCE is a folder (a checkout or an unpacked sdist), an sdist archive (.tar.gz, .zip),
or pypi:NAME==VERSION (the sdist is downloaded with pip now, at generation time; training
never downloads anything). Its package and tests are stored once in the task store as
sources/<repo>.tar.gz beside its licence (sources/<repo>.LICENSE); each task is a small edit
of it (the deletion, and the hidden tests cut out of the agent's test files). How tasks are
chosen and validated: composer_tune/data/feature_generator.py; the format:
composer_tune/data/feature_tasks.py; docs/coding_tasks.md.

--kinds feature,bug also makes procedural bugs (composer_tune/data/procedural_bugs.py). A
repository's tasks of the kinds made replace its earlier ones of those kinds in tasks.jsonl;
counts.json holds, per source, the baseline tests and, per kind, the candidates found, the tasks
kept, why the others were rejected and the caps used (--regenerate makes each source again with
them); a source that gives no task is not kept. Files are written beside their final names and
renamed, so an interrupted run keeps the old store.

--check validates every stored task again instead (after a change to the grader, say): its
hidden tests must all pass on the original (graded once per repository, every task's tests
together) and all fail on the agent's tree, through the split grader, and its deleted code must
be nowhere the sandbox shows (the leak check, composer_tune/data/task_leaks.py); it prints one
line per task and exits 1 if any task fails. --sample K checks K tasks per source.

Examples:
    python tools/make_feature_tasks.py pypi:inflection==0.5.1 --store tests/assets/feature_tasks
    python tools/make_feature_tasks.py ~/src/myproject --name myproject-1.0 --store my_tasks
    python tools/make_feature_tasks.py --regenerate --store tests/assets/feature_tasks
    python tools/make_feature_tasks.py --check --store tests/assets/feature_tasks
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_tune.data.feature_generator import (  # noqa: E402
    GenerationError,
    GenerationSettings,
    detect_layout,
    filter_source,
    generate_tasks,
)
from composer_tune.data.feature_tasks import (  # noqa: E402
    COUNTS_FILE,
    TASKS_FILE,
    FeatureTask,
    FeatureTaskError,
    archive_path,
    extract_archive,
    license_path,
    load_feature_tasks,
    materialize_agent_tree,
    materialize_tests_tree,
    parse_task,
    sample_tasks,
    write_archive,
)
from composer_tune.data.task_leaks import (  # noqa: E402
    find_leaks,
    sandbox_roots,
    store_fingerprints,
)
from composer_tune.rewards.repository import HiddenTestsResult, grade_repository  # noqa: E402
from composer_tune.rewards.sandbox import (  # noqa: E402
    WEAKER_ISOLATION,
    PrivateRootUnavailable,
    isolation_in_effect,
)

_LICENSE_NAMES = re.compile(r"^(LICEN[CS]E|COPYING)(\.(txt|md|rst))?$", re.IGNORECASE)
_COPYLEFT = re.compile(r"GNU (AFFERO |LESSER )?GENERAL PUBLIC|Mozilla Public License", re.I)
_KNOWN_LICENSES = [
    ("MIT", re.compile(r"Permission is hereby granted, free of charge", re.I)),
    ("Apache-2.0", re.compile(r"Apache License,?\s+Version 2\.0", re.I)),
    ("BSD", re.compile(r"Redistribution and use in source and binary forms", re.I)),
    ("ISC", re.compile(r"Permission to use, copy, modify, and/or distribute", re.I)),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "sources", nargs="*", metavar="SOURCE", help="folder, sdist or pypi:NAME==VER"
    )
    parser.add_argument("--store", type=Path, required=True, help="the task store folder")
    parser.add_argument(
        "--name", help="repository name for a single folder or archive SOURCE (default: its name)"
    )
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="make every stored source's tasks again from its archive (no download)",
    )
    parser.add_argument(
        "--check", action="store_true", help="validate the stored tasks again, then exit"
    )
    parser.add_argument(
        "--sample",
        type=int,
        metavar="K",
        help="with --check: only K tasks of each source, spread over its tasks (tests use 1)",
    )
    parser.add_argument(
        "--kinds",
        default="feature",
        help="comma-separated task kinds to make: feature (deletions), bug (procedural bugs)",
    )
    parser.add_argument(
        "--max-tasks",
        type=int,
        default=20,
        help="tasks kept per repository and kind (--regenerate: as counts.json says)",
    )
    parser.add_argument(
        "--max-candidates",
        type=int,
        default=400,
        help="candidates tried per repository and kind (--regenerate: as counts.json says)",
    )
    parser.add_argument("--workers", type=int, default=2, help="candidates tried at once")
    parser.add_argument(
        "--weaker-isolation",
        choices=WEAKER_ISOLATION,
        help="run where the sandbox cannot build its private root (refused otherwise)",
    )
    parser.add_argument(
        "--allow-copyleft",
        action="store_true",
        help="accept GPL/LGPL/AGPL/MPL sources (refused by default)",
    )
    return parser


def _license(root: Path) -> Path:
    found = sorted(p for p in root.iterdir() if p.is_file() and _LICENSE_NAMES.match(p.name))
    if not found:
        raise GenerationError(f"{root}: no LICENSE/COPYING file; tasks keep their source's licence")
    return found[0]


def license_kind(text: str) -> str:
    """A short name for a licence text (MIT, BSD, Apache-2.0, ISC, copyleft or unknown)."""
    if _COPYLEFT.search(text):
        return "copyleft"
    return next((name for name, pattern in _KNOWN_LICENSES if pattern.search(text)), "unknown")


def _unpack(archive: Path, destination: Path) -> Path:
    """Unpack an sdist (regular files only, paths inside) and return its top folder."""
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as packed:
            for member in packed.infolist():
                target = destination / member.filename
                if (
                    member.is_dir()
                    or ".." in Path(member.filename).parts
                    or member.filename.startswith("/")
                ):
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(packed.read(member))
    else:
        with tarfile.open(archive) as packed:
            packed.extractall(destination, filter="data")
    # An sdist has one top folder; a store's archive (--regenerate's input) has none.
    entries = list(destination.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else destination


def _download(requirement: str, into: Path) -> Path:
    """The sdist of ``requirement`` (NAME==VERSION) from the package index, via pip."""
    if "==" not in requirement:
        raise GenerationError(f"pypi:{requirement}: pin a version (pypi:NAME==VERSION)")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--quiet",
        "--dest",
        str(into),
        requirement,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    archives = [p for p in into.iterdir() if p.suffix in (".gz", ".zip")]
    if done.returncode != 0 or len(archives) != 1:
        raise GenerationError(
            f"pip could not download the sdist of {requirement}: {done.stderr[-500:]}"
        )
    return archives[0]


def _resolve(source: str, scratch: Path, name: str | None) -> tuple[Path, str]:
    """(folder, repo name) of one SOURCE argument."""
    if source.startswith("pypi:"):
        archive = _download(source[len("pypi:") :], Path(tempfile.mkdtemp(dir=scratch)))
        folder = _unpack(archive, Path(tempfile.mkdtemp(dir=scratch)))
        return folder, folder.name
    path = Path(source).expanduser()
    if path.is_dir():
        return path, name or path.resolve().name
    if path.is_file():
        folder = _unpack(path, Path(tempfile.mkdtemp(dir=scratch)))
        return folder, name or folder.name
    raise GenerationError(f"{source}: not a folder, an sdist or pypi:NAME==VERSION")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _read_store(store: Path) -> tuple[list[dict], dict]:
    tasks_file, counts_file = store / TASKS_FILE, store / COUNTS_FILE
    rows = []
    if tasks_file.is_file():
        for number, line in enumerate(tasks_file.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                    parse_task(rows[-1])
                except ValueError as err:
                    raise GenerationError(f"{tasks_file}:{number}: {err}") from None
    counts = json.loads(counts_file.read_text()) if counts_file.is_file() else {}
    return rows, counts


def make_repo(
    folder: Path, repo: str, store: Path, settings: GenerationSettings, allow_copyleft: bool
) -> tuple[list[dict], dict]:
    """Store ``folder``'s filtered source and licence; return its tasks (JSON rows) of
    ``settings.kinds`` and their counts (a deletion's at the top level, bugs' under "bug")."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", repo):
        raise GenerationError(f"repository name {repo!r}: use letters, digits and . _ + -")
    licence = _license(folder)
    kind = license_kind(licence.read_text(encoding="utf-8", errors="replace"))
    if kind == "copyleft" and not allow_copyleft:
        raise GenerationError(f"{repo}: copyleft licence ({licence.name}); pass --allow-copyleft")
    layout = detect_layout(folder)
    with tempfile.TemporaryDirectory(prefix="composer-featuresrc-") as scratch:
        filtered = Path(scratch) / repo
        filter_source(folder, filtered, layout)
        shutil.copyfile(licence, filtered / licence.name)
        archive = archive_path(store, repo)
        partial = archive.with_name(archive.name + ".partial")
        try:
            sha256 = write_archive(filtered, partial)
            # Tasks are made from the archive's own contents, exactly what training unpacks.
            unpacked = Path(scratch) / "unpacked"
            extract_archive(partial, unpacked, sha256)
            report = generate_tasks(unpacked, repo, sha256, settings, progress=print)
            os.replace(partial, archive)
        finally:  # a refused source leaves nothing in the store
            partial.unlink(missing_ok=True)
        shutil.copyfile(licence, license_path(store, repo))
    counts: dict = {"license": kind, "baseline_tests": report.baseline_passed}
    for name, made in report.kinds.items():
        max_tasks, max_candidates = settings.limits(name)
        entry = {
            "candidates": made.candidates,
            "tasks": len(made.tasks),
            "rejected": dict(sorted(made.rejected.items())),
            "max_tasks": max_tasks,
            "max_candidates": max_candidates,
        }
        if name == "feature":
            counts.update(entry)
        else:
            counts[name] = entry
    return [json.loads(task.to_json()) for task in report.tasks], counts


def task_kind(row: dict) -> str:
    """A stored task's kind as ``--kinds`` names it."""
    return "bug" if row["feature"]["kind"] == "bug" else "feature"


def _kind_counts(entry: dict) -> dict[str, dict]:
    """A source's counts.json entry per kind (a deletion's at the top level, bugs' under
    "bug")."""
    made = {"feature": entry} if "tasks" in entry else {}
    return made | ({"bug": entry["bug"]} if "bug" in entry else {})


def _as_made(entry: dict, settings: GenerationSettings) -> GenerationSettings:
    """``settings`` for regenerating a source as counts.json says it was made: its kinds, each
    with its max_tasks and max_candidates (``settings``' where it names none)."""
    made = _kind_counts(entry)
    limits = {
        kind: (
            counts.get("max_tasks", settings.max_tasks),
            counts.get("max_candidates", settings.max_candidates),
        )
        for kind, counts in made.items()
    }
    return replace(settings, kinds=tuple(made), kind_limits=limits)


def check_store(
    store: Path, settings: GenerationSettings, isolation: str, sample: int | None = None
) -> int:
    """Grade every stored task's (or a sample's) hidden tests on its agent's tree (one run per
    task) and on the original (one run per repository, every task's hidden tests together: the
    same original tree for all), and search everything the sandbox shows for its deleted code;
    the number of tasks that fail."""
    tasks = load_feature_tasks(store)
    if sample is not None:
        tasks = sample_tasks(tasks, sample)
    prints = {print_.task_id: print_ for print_ in store_fingerprints(store, tasks)}
    # Without the private root the sandbox shows the whole host: nothing to search.
    reachable = (
        find_leaks(list(prints.values()), sandbox_roots()) if isolation == "private_root" else {}
    )
    with tempfile.TemporaryDirectory(prefix="composer-featurecheck-") as scratch:
        scratch = Path(scratch)
        tests_trees: dict[str, Path] = {}
        for task in tasks:
            if task.repo not in tests_trees:
                tests_trees[task.repo] = scratch / "tests" / task.repo
                materialize_tests_tree(store, task, tests_trees[task.repo])

        def grade(tree: Path, task: FeatureTask, node_ids: Sequence[str]) -> HiddenTestsResult:
            return grade_repository(
                tree, tests_tree=tests_trees[task.repo], import_root=task.import_root,
                packages=task.packages, node_ids=node_ids, limits=settings.grade_limits,
            )  # fmt: skip

        def original(index_source: tuple[int, tuple]) -> HiddenTestsResult:
            index, source = index_source
            of_source = [task for task in tasks if _source(task) == source]
            tree = scratch / f"original{index}"
            extract_archive(archive_path(store, source[0]), tree, source[1])
            every_test = sorted({node for task in of_source for node in task.hidden_tests})
            return grade(tree, of_source[0], every_test)

        def check(index_task: tuple[int, FeatureTask]) -> str:
            index, task = index_task
            agent = scratch / f"agent{index}"
            materialize_agent_tree(store, task, agent)
            graded = grade(agent, task, task.hidden_tests)
            unrun = originals[_source(task)].sandbox_failure or graded.sandbox_failure
            if unrun is not None:  # "0 hidden tests pass on the agent's tree" would be a lie
                return f"FAILED {task.id}: not checked, {unrun}"
            outcomes = originals[_source(task)].outcomes
            passed = sum(outcomes[node] == "passed" for node in task.hidden_tests)
            left = sum(outcome == "passed" for outcome in graded.outcomes.values())
            total = len(task.hidden_tests)
            copies = reachable.get(task.id, []) + find_leaks(
                [prints[task.id]], [(str(agent), ())]
            ).get(task.id, [])
            verdict = "ok" if (passed, left, copies) == (total, 0, []) else "FAILED"
            line = f"{verdict} {task.id}: original {passed}/{total}, agent's tree {left}/{total}"
            return line + (f", its deleted code readable at {copies[0]}" if copies else "")

        sources = list(dict.fromkeys(_source(task) for task in tasks))
        with ThreadPoolExecutor(max_workers=settings.workers) as pool:
            originals = dict(zip(sources, pool.map(original, enumerate(sources)), strict=True))
            lines = list(pool.map(check, enumerate(tasks)))
    for line in lines:
        print(line)
    failed = sum(line.startswith("FAILED") for line in lines)
    print(f"{store}: {len(tasks) - failed} of {len(tasks)} tasks validate")
    return failed


def _source(task: FeatureTask) -> tuple[str, str, str, tuple[str, ...]]:
    """What a task's original tree and how it is graded depend on: its repository's archive
    (name and digest), import root and packages."""
    return (task.repo, task.source_sha256, task.import_root, tuple(task.packages))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.sources and not args.regenerate and not args.check:
        print("error: give SOURCE arguments, --regenerate or --check", file=sys.stderr)
        return 2
    if args.sample is not None and (not args.check or args.sample < 1):
        print("error: --sample K needs --check and K >= 1", file=sys.stderr)
        return 2
    if args.name and len(args.sources) != 1:
        print("error: --name needs exactly one SOURCE", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    # A terminated run unwinds (temporary folders removed, the old store kept).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip()))
    if not kinds or not set(kinds) <= {"feature", "bug"}:
        print(f"error: --kinds {args.kinds!r}: use feature, bug or feature,bug", file=sys.stderr)
        return 2
    settings = GenerationSettings(
        kinds=kinds,
        max_tasks=args.max_tasks,
        max_candidates=args.max_candidates,
        workers=args.workers,
    )
    store: Path = args.store
    try:
        isolation = isolation_in_effect(args.weaker_isolation, "make_feature_tasks")
    except PrivateRootUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        try:
            return 1 if check_store(store, settings, isolation, args.sample) else 0
        except FeatureTaskError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    try:
        rows, counts = _read_store(store)
        with tempfile.TemporaryDirectory(prefix="composer-featuretool-") as scratch:
            scratch = Path(scratch)
            work = [(*_resolve(s, scratch, args.name), settings) for s in args.sources]
            if args.regenerate:  # each source as it was made
                for archive in sorted((store / "sources").glob("*.tar.gz")):
                    folder = scratch / "regenerate" / archive.name
                    extract_archive(archive, folder)
                    repo = archive.name.removesuffix(".tar.gz")
                    made = _as_made(counts.get(repo, {}), settings)
                    work.append((folder, repo, made if made.kinds else settings))
            for folder, repo, repo_settings in work:
                print(f"{repo}: making tasks from {folder}")
                repo_rows, new_counts = make_repo(
                    folder, repo, store, repo_settings, args.allow_copyleft
                )
                counts[repo] = {**counts.get(repo, {}), **new_counts}
                rows = [
                    row
                    for row in rows
                    if row["repo"] != repo or task_kind(row) not in repo_settings.kinds
                ] + repo_rows
                rows.sort(key=lambda row: (row["repo"], row["id"]))
                print(f"{repo}: {len(repo_rows)} tasks ({counts[repo]})")
                kept = any(row["repo"] == repo for row in rows)
                if not kept:  # a source no task needs is not kept (its reasons were printed)
                    del counts[repo]
                _write_atomic(
                    store / TASKS_FILE, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
                )
                _write_atomic(
                    store / COUNTS_FILE, json.dumps(dict(sorted(counts.items())), indent=2) + "\n"
                )
                if not kept:
                    archive_path(store, repo).unlink()
                    license_path(store, repo).unlink()
                    print(f"{repo}: no task, so its source is not kept in the store")
    except GenerationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    total = sum(c["tasks"] for e in counts.values() for c in _kind_counts(e).values())
    print(f"{store}: {total} tasks from {len(counts)} repositories")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

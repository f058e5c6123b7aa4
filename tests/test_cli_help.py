"""Every verb's --help (the verbs of `cudnn-fuse --help`, and the cache's actions): a description,
no issue numbers or notes of the project's history, and only repository paths that exist.

Before, `doctor --help` and `demo --help` had no description, `prewarm --help` named
plans/resnet50_fp16.json (no such manifest) and `bench --help` spoke of "issue 6" and of a
METHOD.md that is not in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cudnn_fuse import cli

REPO = Path(cli.__file__).resolve().parents[1]
_PATH = re.compile(r"(?<![\w/.-])((?:plans|bench|docs|tests|cudnn_fuse)/[\w./*<>-]*[\w*>])")
_MARKDOWN = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
_HISTORY = re.compile(r"\bissues? *#? *\d+|\bstops? +\d+|\bsessions?\b", re.I)


def render(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "400")  # one line a paragraph: no path is wrapped
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def listed(help_text: str, metavar: str) -> list:
    """The sub-commands a help text lists under its COMMAND/ACTION metavar."""
    section = help_text.split(f"\n  {metavar}\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^    (\S+)", section, re.M)


def all_verbs() -> list:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        cli.main(["--help"])
    verbs = [[v] for v in listed(out.getvalue(), "COMMAND")]
    out = io.StringIO()
    with redirect_stdout(out):
        cli.main(["cache", "--help"])
    return verbs + [["cache", a] for a in listed(out.getvalue(), "ACTION")]


def test_the_verbs_are_found():
    verbs = all_verbs()
    assert {"doctor", "demo", "autotune", "cache", "prewarm", "record", "bench"} <= {v[0] for v in verbs}
    assert ["cache", "verify"] in verbs and len(verbs) >= 14


def _missing_paths(text: str) -> list:
    missing = []
    for path in _PATH.findall(text):
        if "<" in path:  # a pattern such as peers_<part>.json: its folder must exist
            found = (REPO / path.split("<")[0]).parent.is_dir()
        elif "*" in path:
            found = any(REPO.glob(path))
        else:
            found = (REPO / path).exists()
        if not found:
            missing.append(path)
    for name in _MARKDOWN.findall(text):
        if not any(REPO.glob(f"**/{name}")):
            missing.append(name)
    return missing


@pytest.mark.parametrize("argv", all_verbs(), ids=" ".join)
def test_each_verbs_help_has_a_description_and_only_real_paths(argv, capsys, monkeypatch):
    text = render(capsys, monkeypatch, *argv)
    usage, *paragraphs = text.split("\n\n")
    assert usage.startswith("usage: cudnn-fuse " + " ".join(argv))
    first = paragraphs[0] if paragraphs else ""
    assert first and not first.startswith(("positional arguments:", "options:")), f"{argv}: no description"
    assert len(first.split()) >= 5, f"{argv}: a description of a few words at least: {first!r}"
    assert not _HISTORY.findall(text), f"{argv}: {_HISTORY.findall(text)}"
    assert _missing_paths(text) == [], f"{argv} names paths that are not in the repository"


def test_the_path_check_can_fail():
    assert _missing_paths("see plans/resnet50_fp16.json and METHOD.md") == ["plans/resnet50_fp16.json", "METHOD.md"]
    assert _missing_paths("plans/resnet50_fp16_bs1.json, bench/results/peers_<part>.json, docs/cache.md") == []
    assert _HISTORY.findall("the suite (issue 6) of stop 12") == ["issue 6", "stop 12"]

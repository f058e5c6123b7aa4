"""Numeric environment settings: a malformed value is a logged default, never an import error."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from cudnn_fuse import envvars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# variable -> (module, attribute) it sets at import, and that attribute's default
SETTINGS = {
    "CUDNN_FUSE_MAX_PLANS": ("cudnn_fuse.loader", "DEFAULT_CAPACITY", 1024),
    "CUDNN_FUSE_TUNE_BUDGET_S": ("cudnn_fuse.autotune", "Config.budget_s", 10.0),
    "CUDNN_FUSE_WORKSPACE_CAP": ("cudnn_fuse.autotune", "Config.workspace_cap", 1 << 30),
    "CUDNN_FUSE_TUNE_WAIT_S": ("cudnn_fuse.loader", "TUNE_WAIT_S", 60.0),
}


@pytest.fixture(autouse=True)
def _warnings_said_anew(monkeypatch):
    """A bad value is said once per process: each test starts with none said."""
    monkeypatch.setattr(envvars, "_warned", set())

_CHILD = """
import importlib, json, sys
import cudnn_fuse
out = {}
for var, (mod, attr, _) in json.loads(sys.argv[1]).items():
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    out[var] = obj
print(json.dumps(out))
"""


def _import_with(values: dict):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_FUSE_")}
    env.update(values, PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(SETTINGS)], env=env, capture_output=True,
                       text=True, timeout=240)
    return r


@pytest.mark.parametrize("bad", ["abc", "nan", "-1", "1..5"])
def test_a_malformed_numeric_setting_is_a_logged_default_not_an_import_error(bad):
    """Before, ``import cudnn_fuse`` raised ValueError (naming no variable) for any of these."""
    r = _import_with({var: bad for var in SETTINGS})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for var, (_, _, default) in SETTINGS.items():
        assert got[var] == default, var
        assert var in r.stderr, f"{var} not named in the warnings"


def test_a_good_numeric_setting_is_read():
    r = _import_with({"CUDNN_FUSE_MAX_PLANS": "77", "CUDNN_FUSE_WORKSPACE_CAP": "2e9",
                      "CUDNN_FUSE_TUNE_BUDGET_S": "2.5"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["CUDNN_FUSE_MAX_PLANS"] == 77 and got["CUDNN_FUSE_WORKSPACE_CAP"] == 2_000_000_000
    assert got["CUDNN_FUSE_TUNE_BUDGET_S"] == 2.5


@pytest.mark.parametrize("raw, kw, want", [
    ("3", {}, 3.0), (" 2.5 ", {}, 2.5), ("inf", {}, float("inf")), ("", {}, 7), ("0", {"minimum": 1}, 7),
    ("12", {"integer": True}, 12), ("1e3", {"integer": True}, 1000), ("1.5", {"integer": True}, 7),
    ("inf", {"integer": True}, 7), ("99999999999999999999999", {"integer": True}, 99999999999999999999999),
    ("nan", {}, 7), ("-0.5", {}, 7), ("x", {}, 7),
])
def test_number(monkeypatch, caplog, raw, kw, want):
    monkeypatch.setenv("CUDNN_FUSE_TEST_NUMBER", raw)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.envvars"):
        got = envvars.number("CUDNN_FUSE_TEST_NUMBER", 7, **kw)
    assert got == want and type(got) is type(want)
    assert ("CUDNN_FUSE_TEST_NUMBER" in caplog.text) == (want == 7 and raw.strip() != "")


def test_an_integer_settings_warning_says_its_bound_as_an_integer(monkeypatch, caplog):
    monkeypatch.setenv("CUDNN_FUSE_TEST_NUMBER", "-5")
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.envvars"):
        assert envvars.number("CUDNN_FUSE_TEST_NUMBER", 3, integer=True) == 3
    assert "want an integer >= 0;" in caplog.text


def test_number_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("CUDNN_FUSE_TEST_NUMBER", raising=False)
    assert envvars.number("CUDNN_FUSE_TEST_NUMBER", 1 << 30, integer=True) == 1 << 30


@pytest.mark.parametrize("raw, want", [("inf", 7), ("Infinity", 7), ("1e300", 7), ("10.5", 7), ("10", 10.0),
                                       ("0", 0.0), ("-inf", 7), ("nan", 7)])
def test_number_with_a_maximum(monkeypatch, caplog, raw, want):
    monkeypatch.setenv("CUDNN_FUSE_TEST_NUMBER", raw)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.envvars"):
        got = envvars.number("CUDNN_FUSE_TEST_NUMBER", 7, maximum=10)
    assert got == want and type(got) is type(want)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (want == 7)
    assert all("CUDNN_FUSE_TEST_NUMBER" in m and "<= 10" in m for m in warned)


@pytest.mark.parametrize("raw", ["inf", "+inf", "1e300", "3601"])
def test_an_unbounded_tune_wait_is_a_logged_default(raw):
    """The tune lock waited ``CUDNN_FUSE_TUNE_WAIT_S`` for another process's tuning: inf waited without
    limit (the library hung as long as that process held the lock). A wait past an hour is now one
    warning naming the variable, and the default."""
    r = _import_with({"CUDNN_FUSE_TUNE_WAIT_S": raw})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["CUDNN_FUSE_TUNE_WAIT_S"] == 60.0
    assert r.stderr.count("CUDNN_FUSE_TUNE_WAIT_S") == 1, r.stderr[-2000:]


def test_a_tune_wait_up_to_an_hour_is_read():
    r = _import_with({"CUDNN_FUSE_TUNE_WAIT_S": "3600"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["CUDNN_FUSE_TUNE_WAIT_S"] == 3600.0
    assert "CUDNN_FUSE_TUNE_WAIT_S" not in r.stderr


def test_the_readme_table_lists_exactly_the_variables_the_library_reads():
    """README's environment table and envvars.VARIABLES name the same variables, and every
    CUDNN_FUSE_* name anywhere in the package is one of them (a removed switch leaves no trace)."""
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        rows = {m.group(1) for line in f if (m := re.match(r"\| `(CUDNN_FUSE_[A-Z0-9_]+)`", line))}
    assert rows == set(envvars.VARIABLES)
    assert len(envvars.VARIABLES) <= 12
    named = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "cudnn_fuse")):
        for name in files:
            if name.endswith((".py", ".c")):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    named |= set(re.findall(r"CUDNN_FUSE_[A-Z0-9_]*[A-Z0-9]", f.read()))
    assert named <= set(envvars.VARIABLES), sorted(named - set(envvars.VARIABLES))


def test_only_envvars_reads_the_environment():
    """No module but envvars reads os.environ / os.getenv for a CUDNN_FUSE_ variable."""
    import ast

    pkg = os.path.join(ROOT, "cudnn_fuse")
    readers = []
    for name in os.listdir(pkg):
        if not name.endswith(".py") or name == "envvars.py":
            continue
        with open(os.path.join(pkg, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "getenv", "__getitem__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("CUDNN_FUSE_"):
                readers.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                    str(node.slice.value).startswith("CUDNN_FUSE_") and isinstance(node.ctx, ast.Load):
                readers.append(f"{name}:{node.lineno}")
    assert readers == []


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), (" yes ", True), ("On", True), ("0", False),
                                       ("false", False), ("NO", False), ("off", False), ("", None), ("2", None),
                                       ("enable", None)])
def test_parse_flag(raw, want):
    assert envvars.parse_flag(raw) is want


@pytest.mark.parametrize("raw, default, want, warned", [(None, True, True, False), ("", False, False, False),
                                                        ("0", True, False, False), ("yes", False, True, False),
                                                        ("maybe", True, True, True), ("maybe", False, False, True)])
def test_flag_reads_a_switch_and_says_once_what_it_cannot_read(monkeypatch, caplog, raw, default, want, warned):
    if raw is None:
        monkeypatch.delenv("CUDNN_FUSE_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("CUDNN_FUSE_TEST_FLAG", raw)
    with caplog.at_level(logging.WARNING, logger="cudnn_fuse.envvars"):
        assert envvars.flag("CUDNN_FUSE_TEST_FLAG", default) is want
        assert envvars.flag("CUDNN_FUSE_TEST_FLAG", default) is want
    assert len(caplog.records) == (1 if warned else 0)
    assert all("CUDNN_FUSE_TEST_FLAG" in r.getMessage() for r in caplog.records)


def test_a_switch_is_read_when_it_is_used(monkeypatch):
    """The cache and autotune switches are read at the call, not at import: a process (or a test)
    may set them after importing cudnn_fuse."""
    from cudnn_fuse import autotune, cache

    monkeypatch.setattr(autotune, "_enabled", None)
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "on")
    assert autotune.autotune_enabled() is True
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "off")
    assert autotune.autotune_enabled() is False
    monkeypatch.setenv("CUDNN_FUSE_CACHE", "no")
    assert cache.open_default_cache() is None


@pytest.mark.parametrize("value, want", [(True, True), (False, False), ("no", False), ("false", False), ("0", False),
                                         ("OFF", False), ("yes", True), ("1", True), ("on", True)])
def test_set_autotune_takes_a_bool_or_the_variables_words(monkeypatch, value, want):
    """set_autotune("no") turned tuning on (bool("no") is True); it now reads the words as the
    variable does."""
    from cudnn_fuse import autotune

    monkeypatch.setattr(autotune, "_enabled", None)
    autotune.set_autotune(value)
    assert autotune.autotune_enabled() is want
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "1" if not want else "0")
    autotune.set_autotune(None)  # the variable again
    assert autotune.autotune_enabled() is (not want)


@pytest.mark.parametrize("value", [1, 0, "maybe", "", 1.0, [True]])
def test_set_autotune_refuses_anything_else_naming_the_argument(monkeypatch, value):
    from cudnn_fuse import autotune

    monkeypatch.setattr(autotune, "_enabled", None)
    with pytest.raises(TypeError, match="enabled"):
        autotune.set_autotune(value)
    assert autotune._enabled is None

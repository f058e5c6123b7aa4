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
    "CUDNN_FUSE_MAX_PLANS": ("cudnn_fuse.plans", "DEFAULT_CAPACITY", 1024),
    "CUDNN_FUSE_TUNE_BUDGET_S": ("cudnn_fuse.autotune", "Config.budget_s", 10.0),
    "CUDNN_FUSE_WORKSPACE_CAP": ("cudnn_fuse.autotune", "Config.workspace_cap", 1 << 30),
    "CUDNN_FUSE_PREFER_PRECOMPILED": ("cudnn_fuse.autotune", "Config.prefer_precompiled", 0.0),
    "CUDNN_FUSE_TUNE_HEAT_S": ("cudnn_fuse.autotune", "Config.heat_s", 0.5),
    "CUDNN_FUSE_TORCH_MIN_MS": ("cudnn_fuse.autotune", "TORCH_MIN_MS", 0.1),
    "CUDNN_FUSE_TUNE_WAIT_S": ("cudnn_fuse.loader", "TUNE_WAIT_S", 60.0),
}

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
                      "CUDNN_FUSE_TUNE_BUDGET_S": "2.5", "CUDNN_FUSE_TUNE_HEAT_S": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["CUDNN_FUSE_MAX_PLANS"] == 77 and got["CUDNN_FUSE_WORKSPACE_CAP"] == 2_000_000_000
    assert got["CUDNN_FUSE_TUNE_BUDGET_S"] == 2.5 and got["CUDNN_FUSE_TUNE_HEAT_S"] == 0.0


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


def test_the_readme_states_the_tune_waits_bound():
    from cudnn_fuse import loader

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `CUDNN_FUSE_TUNE_WAIT_S`"))
    assert f"{loader.TUNE_WAIT_MAX_S:g}" in row and "inf" in row

"""`aioengine bench spec --specs`: the entries' speculative configs, a head per entry
(`@DIR`, so two heads run interleaved in one run), and usage errors without a traceback;
the KV prefault it turns on for its own engines only."""
from __future__ import annotations

import argparse
import os

import pytest

from aioengine.bench.spec import _kv_prefault, parse_spec, spec_main


def test_an_entry_may_name_its_own_head() -> None:
    assert parse_spec("off", "/h") is None
    assert parse_spec("eagle3:2", "/h") == {"method": "eagle3", "num_speculative_tokens": 2,
                                             "model": "/h"}
    assert parse_spec("eagle3:2@/v4", "/h") == {"method": "eagle3",
                                                 "num_speculative_tokens": 2, "model": "/v4"}
    assert parse_spec("eagle3@/v4", None) == {"method": "eagle3", "model": "/v4"}
    tree = parse_spec("eagle3tree:4:3:10@/v4", None)
    assert tree is not None and tree["model"] == "/v4" and tree["tree"]["num_nodes"] == 10
    assert parse_spec("auto", None) == {"method": "auto"}
    assert parse_spec("auto", "/h") == {"method": "auto", "model": "/h"}
    for bad in ("off@/v4", "ngram@/v4", "eagle3:2@", "medusa:2", "auto@/v4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_spec(bad, None)


def test_a_bad_entry_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(specs="off,ngram@/v4", draft_model=None)
    assert spec_main(args) == 2
    assert "error: --specs 'ngram@/v4'" in capsys.readouterr().err


@pytest.mark.parametrize("given", [None, "0", "1"])
def test_kv_prefault_is_on_for_the_run_only(monkeypatch, given) -> None:
    """bench spec writes the KV pages at start-up unless told otherwise, and leaves the
    process as it found it (an in-process caller's later engines, e.g. the test suite's)."""
    key = "AIOENGINE_CPU_KV_PREFAULT"
    if given is None:
        monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv(key, given)
    with _kv_prefault() as value:
        assert value == (given or "1") == os.environ[key]
    assert os.environ.get(key) == given

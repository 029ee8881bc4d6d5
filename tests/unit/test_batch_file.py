"""run-batch's file handling without a model: line checks and the resume scan of an output
file (the engine path is tests/e2e/test_run_batch.py)."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from aioengine.server.batch import LineError, completed_ids, input_lines, parse_line

ENDPOINTS = {"/v1/completions": object(), "/v1/embeddings": None}


def line(**fields: object) -> bytes:
    return orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "x"}, **fields})


def test_a_good_line_parses() -> None:
    parsed = parse_line(line(), 3, ENDPOINTS)
    assert (parsed.number, parsed.custom_id, parsed.url, parsed.body) == (
        3, "a", "/v1/completions", {"prompt": "x"})
    assert parsed.size == len(line())


@pytest.mark.parametrize("raw, words, param", [
    (b"{not json", "line 5 is not valid JSON", None),
    (b"[1, 2]", "must be a JSON object, got list", None),
    (line(custom_id=""), "custom_id must be a non-empty string", "custom_id"),
    (line(custom_id=7), "custom_id must be a non-empty string", "custom_id"),
    (line(method="GET"), "method must be POST", "method"),
    (line(url="/v1/audio"), "not a Batch API url", "url"),
    (line(url="/v1/embeddings"), "is not supported by this server", "url"),
    (line(body="x"), "body must be a JSON object", "body"),
])
def test_bad_lines_are_line_errors(raw: bytes, words: str, param: str | None) -> None:
    with pytest.raises(LineError, match=words) as info:
        parse_line(raw, 5, ENDPOINTS)
    assert info.value.param == param


def test_resume_reads_ids_and_cuts_a_partial_last_line(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    assert completed_ids(str(out)) == set()
    records = [orjson.dumps({"id": "x", "custom_id": cid, "response": None, "error": None})
               for cid in ("a", "b")]
    whole = b"\n".join(records) + b"\n" + b'{"id": "y", "custom_id": null}\n'
    out.write_bytes(whole + b'{"id": "z", "custom_id": "c"')  # killed mid-write
    assert completed_ids(str(out)) == {"a", "b"}
    assert out.read_bytes() == whole


def test_input_lines_skip_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"one\n\n  \ntwo")
    assert list(input_lines(str(path))) == [(1, b"one"), (4, b"two")]
